"""The notebooks run top to bottom in a fresh kernel and show what they promise."""

import concurrent.futures
import os
import pathlib

import pytest

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

# Optional: the dev extra installs both; a machine without them skips these tests and says why.
nbformat = pytest.importorskip("nbformat", reason="nbformat (in the dev extra) runs the notebooks")
NotebookClient = pytest.importorskip(
    "nbclient", reason="nbclient (in the dev extra) runs the notebooks"
).NotebookClient

NOTEBOOKS = pathlib.Path(__file__).parent.parent / "notebooks"


def _no_switch() -> str | None:
    """Why the Hugging Face notebook cannot run here (tests/support/hf_models.py), or None."""
    try:
        from .support.hf_models import NO_SWITCH
    except ImportError:  # no transformers: the notebook runs, and its error says so
        return None
    return NO_SWITCH


def _no_torchtitan() -> str | None:
    """Why the torchtitan notebook cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install -e '.[titan]'; torchtitan 0.3 needs Python >= 3.11)"
    return None


# each notebook that cannot run on this torch, transformers or torchtitan (its test skips): not started
CANNOT_RUN = {
    "05_huggingface.ipynb": _no_switch(),
    "06_torchtitan.ipynb": _no_torchtitan(),
}


def execute(name: str, tmp_path) -> str:
    """Run a notebook in a fresh kernel; return everything its cells printed."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel runs in tmp_path: the clone's root goes on its path for benchmarks/ (not installed).
    root = str(NOTEBOOKS.parent.resolve())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute(env=env)
    outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)


# the slowest first: two kernels at a time finish together
NAMES = [
    "03_compile.ipynb",
    "04_zero.ipynb",
    "05_huggingface.ipynb",
    "07_peak.ipynb",
    "02_memory_budget.ipynb",
    "06_torchtitan.ipynb",
    "01_tour.ipynb",
]


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """Every notebook started at once, two kernels at a time (a kernel keeps one core busy and
    this test process waits): ``printed(name)`` waits for one and returns what it printed."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    runs = {
        name: pool.submit(execute, name, tmp_path_factory.mktemp(name.split(".")[0]))
        for name in NAMES
        if not CANNOT_RUN.get(name)
    }
    yield lambda name: runs[name].result()
    pool.shutdown(cancel_futures=True)


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == [
        "01_tour.ipynb",
        "02_memory_budget.ipynb",
        "03_compile.ipynb",
        "04_zero.ipynb",
        "05_huggingface.ipynb",
        "06_torchtitan.ipynb",
        "07_peak.ipynb",
    ]
    assert sorted(NAMES) == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))  # each one is run


def test_the_tour_runs_and_shows_the_router_counting_once_under_tracedac_and_twice_under_torch(printed):
    text = printed("01_tour.ipynb")
    assert "gradients bitwise equal to the un-checkpointed block: True" in text
    assert "torch.utils.checkpoint     512 tokens counted (true count 256)" in text
    assert "tracedac.checkpoint        256 tokens counted (true count 256)" in text
    assert "attention_only -> MUST_SAVE" in text and "save_matmuls() -> MUST_SAVE" in text
    assert "CheckpointError: buffer 'expert_bias'" in text
    assert "no checkpoint                all-to-alls: 3 in forward, 2 in backward" in text
    assert "torch.utils.checkpoint       all-to-alls: 3 in forward, 5 in backward" in text
    assert "tracedac recompute_all       all-to-alls: 3 in forward, 2 in backward" in text
    assert "tracedac memory_budget(0.3)  all-to-alls: 3 in forward, 2 in backward" in text


def test_the_memory_budget_notebook_sweeps_plots_picks_and_reports(printed):
    text = printed("02_memory_budget.ipynb")
    assert "plans on the frontier" in text and "recompute_all()" in text and "save_matmuls()" in text
    assert "<Figure" in text, "the frontier is plotted"
    assert "kept by memory_budget(" in text, "the report says which planner kept each tensor"
    assert "within budget: True" in text
    assert "last step's gradients bitwise equal to the un-checkpointed block's: True" in text
    assert "min_cut keeps" in text


def test_the_compile_notebook_shows_each_policys_partition_side_effects_and_gradients(printed):
    text = printed("03_compile.ipynb")
    assert "no checkpoint:" in text and "recompute_all()" in text and "memory_budget(0.5)" in text
    assert "save_matmuls() -> MUST_SAVE" in text, "print_saved names the decision of each saved value"
    assert "replayed in backward under recompute_all():" in text and "aten.addmm.default" in text
    assert "Block|memory_budget(0.1)" in text and "Block|memory_budget(0.9)" in text
    assert "tokens counted: 128 (true count 128)" in text
    assert "gradients equal to the compiled model without checkpointing: True" in text


@pytest.mark.skipif(bool(CANNOT_RUN["05_huggingface.ipynb"]), reason=CANNOT_RUN["05_huggingface.ipynb"] or "")
def test_the_huggingface_notebook_trains_with_tracedac_under_the_trainer(printed):
    text = printed("05_huggingface.ipynb")
    assert "kept by memory_budget(0.5)" in text and "model.layers.1.mlp.up_proj" in text
    assert "regions: ['model.layers.0', 'model.layers.1']" in text
    assert "tracedac: training loss" in text and "MLP calls per layer in 4 steps: {'0': 4, '1': 4}" in text
    assert "checkpoint function of layer 0: tracedac.integrations.hf(policy=memory_budget(0.5))" in text
    assert "torch's checkpoint: training loss" in text and "in 4 steps: {'0': 8, '1': 8}" in text
    assert "weights after training bitwise equal to the run without checkpointing: True" in text
    assert "state_dict keys unchanged: True" in text and "checkpointing on: False" in text


@pytest.mark.skipif(bool(CANNOT_RUN["06_torchtitan.ipynb"]), reason=CANNOT_RUN["06_torchtitan.ipynb"] or "")
def test_the_torchtitan_notebook_shows_torchs_doubled_counts_the_halving_trap_and_enable(printed):
    text = printed("06_torchtitan.ipynb")
    row = (
        "tokens counted per MoE layer: {} (true count 192); "
        "expert bias after 3 steps equal to no checkpoint's: {}"
    )
    assert "no checkpoint" in text and row.format("[192, 192]", True) in text
    assert "torch's checkpoint (FullAC)              " + row.format("[384, 384]", True) in text
    assert "checkpoint_fn=tracedac.checkpoint_call   " + row.format("[192, 192]", False) in text
    assert "2 warnings, the first: tracedac.checkpoint_call runs a torchtitan MoE block" in text
    assert "tracedac (FullAC, enable())              " + row.format("[192, 192]", True) in text
    assert "tracedac (SelectiveAC, enable())         " + row.format("[192, 192]", True) in text
    assert "layer 1: tracedac.integrations.torchtitan(context_fn)" in text


def test_the_zero_notebook_shows_shards_gathers_in_the_graph_wire_bytes_and_memory(printed):
    import ast
    import re

    text = printed("04_zero.ipynb")
    assert "blocks.0.up.weight     DTensor  (Shard(dim=0),)" in text
    assert "forward graph of block 0: ['all_gather', 'release']" in text
    assert "backward graph of block 0: ['all_gather', 'reduce_grad']" in text and "graph breaks: 0" in text

    def row(name):
        bytes_, ratio = re.search(rf"{re.escape(name)} +(\{{.*\}})  / fp32 bytes: ([0-9.]+)", text).groups()
        return ast.literal_eval(bytes_), float(ratio)

    for name in ("bf16, module list", "bf16 auto, eager, step 2", "bf16 auto, compiled"):
        got, ratio = row(name)
        assert 0.5 <= ratio <= 0.51, (name, ratio)  # Linear weights in bf16, the LayerNorms' fp32
        assert got["bfloat16"] > 100 * got["float32"], (name, got)
    assert set(row("bf16 auto, eager, step 1")[0]) == {"float32"}  # the observed first step
    # one rank sends nothing: no collective at all (the AllGatherCounter saw every row's steps)
    assert "collectives the process group ran in all of it (one rank): none" in text
    assert "unit 'blocks.0' (trainable LayerNorm, auto dtype parameters): travels in torch.float32" in text
    assert "unit 'blocks.0' (trainable Linear, auto dtype parameters): travels in torch.bfloat16" in text
    sharded, plain, unit = map(
        float,
        re.search(
            r"held after forward: sharded ([0-9.]+) KiB, unsharded ([0-9.]+) KiB; "
            r"one block's parameters in fp32: ([0-9.]+) KiB",
            text,
        ).groups(),
    )
    assert abs(sharded - plain) < unit / 4  # activations only: no gathered block outlives its forward


def test_the_peak_notebook_sweeps_the_whole_model_picks_a_budget_and_trains_within_it(printed):
    text = printed("07_peak.ipynb")
    assert "torch compiled (0.5)" in text and "torch selective (matmuls)" in text and "no checkpoint" in text
    assert "every budget's measured peak within it: True" in text
    assert "a larger budget never peaks lower: True" in text
    assert "<Figure" in text, "the frontier is plotted"
    assert "measured peak of the steps after planning" in text and "kept beyond least" in text
    assert "CheckpointError: peak(" in text and "cannot be met" in text
