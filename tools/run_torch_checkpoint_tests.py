"""Run torch's own checkpoint tests with tracedac in place of torch's checkpoint.

    python tools/run_torch_checkpoint_tests.py PATH/TO/pytorch/test [--torch] [--reentrant-as-non-reentrant]
        [-k TEXT] [--no-slow] [-v]

PATH is the ``test`` directory of a PyTorch source checkout of the installed torch's version
(torch's tests are not in its wheel, and tracedac does not carry them). From it this runs

- ``test_utils.py``: ``TestCheckpoint``;
- ``test_autograd.py``: the ``TestAutograd`` tests that call checkpoint, ``TestNestedCheckpoint``
  and ``TestSelectiveActivationCheckpoint``;

with ``torch.utils.checkpoint.checkpoint`` (which ``checkpoint_sequential`` calls) and the
name ``checkpoint`` in each test module replaced by ``tracedac.checkpoint_call``, and prints
one line per test: PASS, FAIL, ERROR or SKIP, with the first line of what failed and, where
it is recognisable, why (``use_reentrant=True``, which tracedac refuses by design). ``--torch``
runs the same tests under torch's own checkpoint, to tell apart what fails in this
environment anyway. docs/torch_tests.md lists the tests tracedac does not pass, and why.
Each test runs in a forked child, so one that aborts the process is reported and the run
goes on (POSIX only). Exit status 0 when every test run passed or skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
import unittest

# Where each class is; for TestAutograd only the tests whose code calls checkpoint.
CLASSES = {
    "test_utils": ("TestCheckpoint",),
    "test_autograd": ("TestAutograd", "TestNestedCheckpoint", "TestSelectiveActivationCheckpoint"),
}
ONLY_CHECKPOINT_TESTS = {"TestAutograd"}


def _load(test_dir: str, name: str):
    path = os.path.join(test_dir, f"{name}.py")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: pass the test/ directory of a PyTorch source checkout")
    spec = importlib.util.spec_from_file_location(f"torch_tests_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _calls_checkpoint(method) -> bool:
    fn = inspect.unwrap(method)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return "checkpoint" in getattr(method, "__name__", "")
    return "checkpoint" in source


def _tests(module, class_name: str) -> list:
    cls = getattr(module, class_name, None)
    if cls is None:
        print(f"# {module.__name__} has no class {class_name}: skipped")
        return []
    names = unittest.TestLoader().getTestCaseNames(cls)
    if class_name in ONLY_CHECKPOINT_TESTS:
        names = [n for n in names if _calls_checkpoint(getattr(cls, n))]
    return [cls(n) for n in names]


class _Result(unittest.TestResult):
    """Outcome per test: the worst of the test and its subtests, and why each part failed."""

    def __init__(self):
        super().__init__()
        self.outcome = "PASS"
        self.detail = ""
        self.reasons = []  # (subtest or "", why) for each failed part

    def _fail(self, kind, err, part=""):
        text = "".join(traceback.format_exception(*err))
        self.reasons.append((part, _why(text)))
        if self.outcome in ("PASS", "SKIP"):
            self.outcome, self.detail = kind, text

    def addFailure(self, test, err):
        self._fail("FAIL", err)

    def addError(self, test, err):
        self._fail("ERROR", err)

    def addSubTest(self, test, subtest, err):
        if err is not None:
            part = subtest._subDescription().strip()
            self._fail("FAIL" if issubclass(err[0], test.failureException) else "ERROR", err, part)

    def addSkip(self, test, reason):
        if self.outcome == "PASS":
            self.outcome, self.detail = "SKIP", reason

    def addExpectedFailure(self, test, err):
        pass  # an expected failure is a pass, as unittest counts it

    def addUnexpectedSuccess(self, test):
        self._fail("FAIL", (AssertionError, AssertionError("unexpected success"), None))


def _run_isolated(test) -> tuple:
    """Run ``test`` in a forked child: (outcome, why, detail). A test that kills its process
    (an exception thrown through C++ that cannot take one aborts it) is reported, not fatal."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            result = _Result()
            test.run(result)
            why = "; ".join(f"{p}: {w}" if p else w for p, w in result.reasons)
            why = why or result.detail
            payload = json.dumps([result.outcome, why, result.detail])
            with os.fdopen(write, "w") as f:
                f.write(payload)
        except BaseException:  # noqa: BLE001 (report anything)
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        payload = f.read()
    _, status = os.waitpid(pid, 0)
    if payload:
        return tuple(json.loads(payload))
    if os.WIFSIGNALED(status):
        why = f"the process died of signal {os.WTERMSIG(status)} (an exception thrown through C++ aborts it)"
    else:
        why = f"the process exited with status {os.WEXITSTATUS(status)} before reporting"
    return "ERROR", why, why


def _why(detail: str) -> str:
    if "does not run reentrant checkpointing" in detail:
        return "use_reentrant=True: refused by tracedac by design"
    lines = [ln for ln in detail.strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:200] if lines else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test_dir", help="the test/ directory of a PyTorch source checkout")
    p.add_argument("--torch", action="store_true", help="run under torch's own checkpoint (the baseline)")
    p.add_argument("-k", dest="filter", default="", help="only tests whose id contains this text")
    p.add_argument("--no-slow", action="store_true", help="skip the tests torch marks @slowTest")
    p.add_argument("-v", "--verbose", action="store_true", help="print each failure's traceback")
    p.add_argument(
        "--reentrant-as-non-reentrant",
        action="store_true",
        help="run use_reentrant=True calls as use_reentrant=False (what tracedac does with the "
        "tests written for reentrant checkpointing; their reentrant-only checks then fail)",
    )
    args = p.parse_args(argv)

    if not args.no_slow:
        os.environ.setdefault("PYTORCH_TEST_WITH_SLOW", "1")  # read when common_utils is imported
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")  # the failure itself as the last line
    test_dir = os.path.abspath(args.test_dir)
    sys.path.insert(0, test_dir)  # the test files import their neighbours

    import torch
    import torch._dynamo  # noqa: F401 (TestCase.run imports it: once here, not in every child)
    import torch.utils.checkpoint

    modules = {name: _load(test_dir, name) for name in CLASSES}
    if not args.torch:
        import tracedac

        run = tracedac.checkpoint_call
        if args.reentrant_as_non_reentrant:

            def run(function, *a, use_reentrant=None, **kw):
                return tracedac.checkpoint_call(function, *a, use_reentrant=False, **kw)

        torch.utils.checkpoint.checkpoint = run
        for module in modules.values():
            if getattr(module, "checkpoint", None) is not None:
                module.checkpoint = run
    print(f"# torch {torch.__version__}; checkpoint: {'torch' if args.torch else 'tracedac.checkpoint_call'}")

    counts = {"PASS": 0, "FAIL": 0, "ERROR": 0, "SKIP": 0}
    for name, classes in CLASSES.items():
        for class_name in classes:
            for test in _tests(modules[name], class_name):
                test_id = f"{name}.{class_name}.{test._testMethodName}"
                if args.filter and args.filter not in test_id:
                    continue
                start = time.perf_counter()
                outcome, why, detail = _run_isolated(test)
                took = time.perf_counter() - start
                counts[outcome] += 1
                print(f"{outcome:5} {test_id} ({took:.1f} s){': ' + why if why else ''}", flush=True)
                if args.verbose and outcome in ("FAIL", "ERROR"):
                    print(detail)
    print(
        f"# {counts['PASS']} passed, {counts['FAIL']} failed, {counts['ERROR']} errors, "
        f"{counts['SKIP']} skipped"
    )
    return 0 if counts["FAIL"] + counts["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
