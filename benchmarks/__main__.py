"""``python -m benchmarks``: compare tracedac with torch's checkpointing and print the figures.

By default it runs the checkpointing comparison on the embedded MoE model (see
``checkpointing``); ``--kernels`` runs the kernel benchmark instead; ``--planners`` the
planner benchmark (``planners``: ``memory_budget`` against torch.compile's
``activation_memory_budget`` on a small Llama); ``--compile`` checkpointing inside one
``torch.compile`` graph (``compiled``); ``--zero``, under
``torchrun --nproc-per-node 2``, compares ZeRO-3 implementations (see ``zero``; with
``--compile``, compiled); ``--ep`` checkpoints an expert-parallel MoE on ``--ranks`` gloo
ranks it starts itself and counts the collectives (``ep``); ``--fsdp2`` checkpoints the blocks
of an FSDP2 (``fully_shard``) model by torch and by tracedac on gloo ranks it starts
(``fsdp2``); ``--profile``
breaks one step down with torch.profiler (``profile``); ``--llama`` times a Llama-style decoder,
the issue-18 GPU comparison (``llama_steps``); ``--peak`` one budget for the whole model
(``policies.peak``) on the Llama and MoE models beside torch's options (``peak``). Progress goes to
stderr, the table to stdout, and ``--json PATH`` writes every figure. Performance goals
are printed as goals, each ``met`` or ``missed`` on this run; the exit status stays 0, since
a slow or loaded machine is not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

from .model import Config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Compare tracedac with torch.utils.checkpoint, torch's selective "
        "checkpointing and torch_remat on a GPT-style MoE model: step time, bytes held after "
        "forward, gradient difference, and how many times the MoE router counts its tokens.",
    )
    default = Config()
    size = p.add_argument_group("model size (defaults: about a minute on a 2-core CPU)")
    size.add_argument("--layers", type=int, default=default.layers, help="transformer blocks (%(default)s)")
    size.add_argument("--dim", type=int, default=default.dim, help="hidden size (%(default)s)")
    size.add_argument("--heads", type=int, default=default.heads, help="attention heads (%(default)s)")
    size.add_argument(
        "--experts", type=int, default=default.experts, help="MoE experts per block (%(default)s)"
    )
    size.add_argument("--top-k", type=int, default=default.top_k, help="experts per token (%(default)s)")
    size.add_argument(
        "--expert-hidden",
        type=int,
        default=default.expert_hidden,
        help="width of each expert's feed-forward (%(default)s)",
    )
    size.add_argument("--vocab", type=int, default=default.vocab, help="vocabulary size (%(default)s)")
    size.add_argument("--batch", type=int, default=default.batch, help="sequences per step (%(default)s)")
    size.add_argument(
        "--dropout", type=float, default=default.dropout, help="dropout probability (%(default)s)"
    )
    size.add_argument("--seq", type=int, default=default.seq, help="tokens per sequence (%(default)s)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per variant, after one untimed "
        "(8; 3 with --planners; 4 with --zero, whose bf16 steps take seconds on CPUs without AVX512-BF16)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (%(default)s)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny built-in model (size flags are ignored) and at most two steps: "
        "checks the set-up in seconds",
    )
    p.add_argument(
        "--kernels", action="store_true", help="run the kernel benchmark instead of the comparison"
    )
    p.add_argument(
        "--planners",
        action="store_true",
        help="run the planner benchmark instead: memory_budget at budgets 0.0 to 1.0 against "
        "torch.compile's activation_memory_budget on a 2-layer Llama (size flags are ignored; "
        "--steps, --quick, --json, --quiet, --system-malloc apply)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compare checkpointing inside one torch.compile graph instead (inductor, fullgraph=True; "
        "the MoE model with fixed-capacity routing; size flags, --steps, --quick, --json apply); "
        "with --zero: tracedac.zero compiled against FSDP2 compiled and against itself eager",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one step instead (torch.profiler): the "
        "recorded forward and the replaying backward of tracedac recompute_all beside the plain "
        "model's, time inside aten ops and outside them, the costliest ops (see profile.py); with "
        "--llama, of the Llama-style decoder",
    )
    p.add_argument(
        "--llama",
        action="store_true",
        help="time a Llama-style decoder instead (llama_steps.py): "
        "torch's checkpoint (eager, selective, under torch.compile) against tracedac's policies and "
        "compiled replay; on cuda at the issue's size in bf16 (size flags are ignored; --steps, --quick, "
        "--json, --only apply)",
    )
    p.add_argument(
        "--peak",
        action="store_true",
        help="one budget for the whole model instead (peak.py): policies.peak at 8 budgets from full "
        "recompute's measured peak to no checkpointing's, on the Llama and the MoE models, beside torch's "
        "checkpoint, its selective checkpointing and torch.compile under activation_memory_budget; "
        "measured peak and step time of trained steps (--steps, --quick, --json, --device apply)",
    )
    p.add_argument(
        "--peak-backend",
        default=None,
        help="with --peak: torch.compile's backend for torch's compiled variants "
        "(default: aot_eager_decomp_partition on the CPU, inductor on CUDA)",
    )
    p.add_argument(
        "--only",
        metavar="KEYS",
        help="with --llama: a comma-separated subset of its variants "
        "(llama_variants.py; e.g. none, torch, torch_sac, tracedac_recompute_all, tracedac_save_matmuls, "
        "tracedac_compiled_replay, tracedac_budget_offload, c_torch, c_tracedac_recompute_all)",
    )
    p.add_argument(
        "--compiled-replay",
        choices=["on", "off"],
        help="replay through compiled functions in every tracedac variant (on) or op by op (off); "
        "left out: tracedac's default, compiled on CUDA and op by op on the CPU",
    )
    p.add_argument(
        "--zero",
        action="store_true",
        help="compare ZeRO-3 implementations instead; run it as "
        "`torchrun --nproc-per-node 2 -m benchmarks --zero` (CPU, gloo), or on a GPU as one process "
        "with `--device cuda` (NCCL, a world of one rank; under torchrun each rank on cuda:LOCAL_RANK)",
    )
    p.add_argument(
        "--ep",
        action="store_true",
        help="checkpoint an expert-parallel MoE instead (ep.py): all-to-alls per step, bytes held "
        "after forward, step time and gradient difference under torch's checkpoint, its selective "
        "checkpointing saving the all-to-alls, and tracedac; starts --ranks gloo processes itself "
        "(size flags --layers --dim --experts --top-k --expert-hidden, and --batch x --seq tokens "
        "split over the ranks, apply; --steps, --quick, --json too)",
    )
    p.add_argument(
        "--fsdp2",
        action="store_true",
        help="tracedac regions inside FSDP2 instead (fsdp2.py): fully_shard per block then the model, "
        "each block checkpointed by torch or by tracedac, on --ranks gloo processes it starts itself "
        "(with --device cuda: NCCL ranks, one GPU each, one rank by default): bytes held after forward, "
        "step time, gradient difference and router counts, ratios to torch "
        "(size flags, --steps, --quick, --json apply)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="with --ep or --fsdp2: how many ranks (processes, one thread each) to start (2)",
    )
    p.add_argument(
        "--init-method",
        default="env://",
        help="with --zero: the process group's rendezvous "
        "(%(default)s, as torchrun sets it; or file:///PATH, with RANK and WORLD_SIZE in the environment; "
        "--device cuda without them: a world of one, by default in a fresh temporary file)",
    )
    p.add_argument(
        "--llama-shape",
        choices=["7b"],
        default=None,
        help="with --llama (or --profile --llama): a 7B-class layer shape (dim 4096, 32 heads, MLP 11008, "
        "4 layers, 8 x 2048 tokens) instead of the device's default size",
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure to PATH as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="time with glibc's default behaviour of returning freed memory to the OS "
        "(by default freed memory is kept for reuse, as torch's CUDA allocator does: see probe.py)",
    )
    return p


def _config(args) -> Config:
    names = {f.name for f in fields(Config)}
    return replace(Config(), **{k: v for k, v in vars(args).items() if k in names})


def _write_json(path: str, figures: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(figures, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a file


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.ranks is not None and not (args.ep or args.fsdp2):
        parser.error(
            "--ranks is for --ep and --fsdp2, which start their own ranks; --zero runs under torchrun"
        )
    if args.compiled_replay is not None:
        import tracedac

        tracedac.compiled_replay(args.compiled_replay == "on")
    if args.kernels:
        try:
            from . import kernels  # imported here: it may need packages the comparison does not
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.kernels":
                raise
            parser.error(
                "--kernels runs benchmarks/kernels.py, which this checkout does not have; "
                "run without --kernels for the checkpointing comparison."
            )
        figures = kernels.run(quick=args.quick)
        print(json.dumps(figures, indent=2, default=str))
    elif args.planners:
        from . import planners, probe
        from .llama import LlamaConfig

        if args.steps is None:
            args.steps = planners.STEPS
        try:
            planners.check_settings(planners.QUICK if args.quick else LlamaConfig(), args.steps, args.device)
        except (ValueError, probe.ProbeUnavailable) as e:
            parser.error(str(e))
        figures = planners.run(
            steps=args.steps,
            quick=args.quick,
            progress=None if args.quiet else sys.stderr,
            system_malloc=args.system_malloc,
        )
        print(planners.format_report(figures))
    elif args.peak:
        from . import peak

        figures = peak.run(
            steps=args.steps or (1 if args.quick else peak.STEPS),
            rounds=1 if args.quick else peak.ROUNDS,
            budgets=3 if args.quick else peak.BUDGETS,
            quick=args.quick,
            device=args.device,
            backend=args.peak_backend,
            progress=None if args.quiet else sys.stderr,
        )
        print(peak.format_report(figures))
    elif args.zero:  # with --compile too: the compiled ZeRO rows
        return _zero(parser, args)
    elif args.ep:
        from . import ep, probe

        world = ep.RANKS if args.ranks is None else args.ranks
        steps = ep.STEPS if args.steps is None else args.steps
        cfg = ep.QUICK if args.quick else _config(args)
        try:
            ep.check_settings(cfg, min(steps, 2) if args.quick else steps, world)
        except (ValueError, probe.ProbeUnavailable) as e:
            parser.error(str(e))
        figures = ep.run(
            _config(args),
            world=world,
            steps=steps,
            quick=args.quick,
            progress=None if args.quiet else sys.stderr,
        )
        print(ep.format_report(figures))
    elif args.fsdp2:
        from . import fsdp2, probe

        on_cuda = args.device.startswith("cuda")
        world = (1 if on_cuda else fsdp2.RANKS) if args.ranks is None else args.ranks
        steps = fsdp2.STEPS if args.steps is None else args.steps
        try:
            fsdp2.check_settings(
                fsdp2.QUICK if args.quick else _config(args),
                min(steps, 2) if args.quick else steps,
                world,
                args.device,
            )
        except (ValueError, probe.ProbeUnavailable) as e:
            parser.error(str(e))
        figures = fsdp2.run(
            _config(args),
            world=world,
            steps=steps,
            quick=args.quick,
            progress=None if args.quiet else sys.stderr,
            device=args.device,
        )
        print(fsdp2.format_report(figures))
    elif args.compile:
        from . import compiled

        try:
            cfg = _config(args)
            cfg.check()
        except ValueError as e:
            parser.error(str(e))
        figures = compiled.run(
            cfg,
            steps=args.steps or compiled.STEPS,
            quick=args.quick,
            progress=None if args.quiet else sys.stderr,
        )
        print(compiled.format_report(figures))
    elif args.profile:
        from . import checkpointing, llama_steps, profile

        if args.llama:
            cfg = (
                # eight tiny layers: a forward Python dominates, where the floors differ most
                replace(llama_steps.QUICK, layers=8)
                if args.quick
                else llama_steps.SHAPES.get(args.llama_shape)
                or (llama_steps.CUDA if args.device.startswith("cuda") else llama_steps.CPU)
            )
        else:
            cfg = checkpointing.QUICK if args.quick else _config(args)
        try:
            checkpointing.check_settings(checkpointing.QUICK, 1, args.device)
        except ValueError as e:
            parser.error(str(e))
        figures = profile.run(cfg, args.device)
        print(profile.format_report(figures))
    elif args.llama:
        from . import checkpointing, llama_steps

        try:
            checkpointing.check_settings(checkpointing.QUICK, 1, args.device)
        except ValueError as e:
            parser.error(str(e))
        only = tuple(args.only.split(",")) if args.only else None
        unknown = set(only or ()) - {v.key for v in llama_steps.VARIANTS}
        if unknown:
            parser.error(f"--only names unknown variants {sorted(unknown)}")
        figures = llama_steps.run(
            llama_steps.QUICK if args.quick else llama_steps.SHAPES.get(args.llama_shape),
            device=args.device,
            steps=args.steps or (2 if args.quick else 5),
            variants=only,
            progress=None if args.quiet else sys.stderr,
        )
        print(llama_steps.format_report(figures))
    else:
        from . import checkpointing, probe

        if args.steps is None:
            args.steps = checkpointing.STEPS
        try:
            cfg = _config(args)
            checkpointing.check_settings(checkpointing.QUICK if args.quick else cfg, args.steps, args.device)
        except (ValueError, probe.ProbeUnavailable) as e:
            parser.error(str(e))
        figures = checkpointing.run(
            cfg,
            steps=args.steps,
            device=args.device,
            quick=args.quick,
            progress=None if args.quiet else sys.stderr,
            system_malloc=args.system_malloc,
        )
        print(checkpointing.format_report(figures))
    if args.json:
        _write_json(args.json, figures)
    return 0


def _zero(parser: argparse.ArgumentParser, args) -> int:
    from . import probe, zero  # zero imports torch.distributed: only when asked for
    from .child import leave_ranks

    if args.steps is None:
        args.steps = zero.STEPS
    # Under torchrun (or RANK and WORLD_SIZE set by hand): one of several ranks. Without: on
    # CUDA, a world of one process; on CPU, refused (one rank shards nothing).
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) if launched else None
        device = zero.rank_device(args.device, local_rank)
    except ValueError as e:
        parser.error(str(e))
    if not launched and device.type != "cuda":
        parser.error(zero.NOT_DISTRIBUTED)
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    try:
        zero.check_settings(zero.QUICK if args.quick else _config(args), args.steps, device, world)
    except (ValueError, probe.ProbeUnavailable) as e:
        parser.error(str(e))
    if launched:
        init_method = args.init_method
        rank = zero.init(init_method, device=device)
    else:
        given = args.init_method != "env://"  # (env:// needs torchrun's variables)
        init_method = args.init_method if given else zero.one_process_rendezvous()
        mine = None if given else Path(init_method[len("file://") :])  # removed on the way out
        try:
            rank = zero.init(init_method, device=device, rank=0, world=1)
        except BaseException:
            if mine is not None:
                mine.unlink(missing_ok=True)
            raise
    try:
        figures = zero.run(
            _config(args),
            steps=args.steps,
            quick=args.quick,
            progress=None if args.quiet else sys.stderr,
            system_malloc=args.system_malloc,
            compile=args.compile,
            device=device,
        )
        if rank == 0:  # one table and one file, however many ranks
            print(zero.format_report(figures))
            if args.json:
                _write_json(args.json, figures)
    except BaseException:
        if not launched:
            # One process: nobody waits on its group. Out now, with the error, rather than
            # through an NCCL teardown after a failure (a CUDA error can make it hang).
            import traceback

            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            if mine is not None:
                mine.unlink(missing_ok=True)
            os._exit(1)
        zero.finish()
        raise
    leave_ranks(init_method)  # does not return
    return 0


if __name__ == "__main__":
    sys.exit(main())
