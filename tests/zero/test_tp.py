"""Zero and tensor parallel composed on a 2 x 2 mesh (issue 29, item 4), on 4 gloo ranks.

Each block's Linears are tensor parallel over ``mesh["tp"]`` (torch's ``parallelize_module``),
the model is sharded by ``zero.shard`` over ``mesh["dp"]``, every block is a tracedac region
(``tp_workers``), eager and compiled. One spawn runs every part; the oracles are one process
on the whole batch and FSDP2 with the same tensor (and sequence) parallel (docs/design.md,
"ZeRO with tensor parallelism").
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from . import tp_workers as tw
from .spawn import part, run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

PARTS = ("train", "collectives", "mixed", "auto", "compiled", "against_fsdp2", "refusals")


@pytest.fixture(scope="module")
def reference():
    return tw.reference()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("tp"))
    parts = [(name, (tmp,) if name in ("train", "compiled") else ()) for name in PARTS]
    return run_ranks(tw.several, 4, parts, timeout=480)


def _close(a, b, tol):
    assert len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


def test_losses_equal_one_process_on_the_whole_batch_over_three_steps(ranks, reference):
    """Each dp half of the batch on two TP ranks, gradients reduce-scattered over dp: the
    updates of one process on the whole batch."""
    for r in part(ranks, "train"):
        assert len(r["losses"]) == tw.STEPS
        _close(r["losses"], reference["losses"], 1e-5)


def test_clip_grad_norm_counts_tp_shards_once_each_and_replicated_parameters_once(ranks, reference):
    """zero.clip_grad_norm_ sums a TP-sharded gradient over dp and TP, a replicated one over
    dp only: the whole model's norm (clipping is active at every step)."""
    assert all(n > tw.CLIP for n in reference["norms"])
    for r in part(ranks, "train"):
        _close(r["norms"], reference["norms"], 1e-5)


def test_parameters_after_the_steps_equal_the_references(ranks, reference):
    params = part(ranks, "train")[0]["params"]
    assert params.keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        assert params[name].shape == want.shape, name
        assert float((params[name] - want).abs().max()) <= 1e-5, name


def test_parameters_are_dtensors_on_the_2d_mesh_sharded_over_dp_and_placed_as_tp_placed_them(ranks):
    """Optimizers and DCP see one mesh for the whole model; a Colwise weight's rows are cut by TP
    first, then by dp (_StridedShard), as FSDP2 lays them out."""
    strided = _StridedShard(0, split_factor=2)
    want = {
        "blocks.0.up.weight": (strided, Shard(0)),
        "blocks.0.up.bias": (strided, Shard(0)),
        "blocks.0.down.weight": (Shard(0), Shard(1)),
        "blocks.0.down.bias": (Shard(0), Replicate()),
        "blocks.0.norm.weight": (Shard(0), Replicate()),
        "head.weight": (Shard(0), Replicate()),
    }
    for r in part(ranks, "train"):
        assert {dims for dims, _ in r["placements"].values()} == {("dp", "tp")}
        assert {k: r["placements"][k][1] for k in want} == want


@pytest.mark.parametrize(
    "case",
    tw.AGAINST_FSDP2,
    ids=lambda c: f"{'compiled' if c[0] else 'eager'}-{'sp' if c[1] else 'tp'}-{c[2]}",
)
def test_each_rank_holds_fsdp2s_shard_of_every_parameter_and_trains_it_as_fsdp2_does(ranks, case):
    """FSDP2 with the same tensor parallel is the oracle: on every rank each parameter's local
    shard is FSDP2's, bit for bit, before training and within 1e-6 after three AdamW steps
    (eager, and each block compiled; tensor parallel alone, and with sequence parallel, whose
    norm weights are replicated DTensors with partial gradients), with FSDP2's losses. A TP
    parameter is placed as FSDP2 places it; a plain one sits on the 2-D mesh, replicated over
    tp, where FSDP2 leaves it on the dp mesh alone (one mesh for the model: torch's
    clip_grad_norm_ works, above)."""
    for r in part(ranks, "against_fsdp2"):
        want, got = r[case, "fsdp2"], r[case, "zero"]
        _close(got["losses"], want["losses"], 1e-6)
        for name, (placements, local) in want["before"].items():
            mine, shard = got["before"][name]
            assert torch.equal(shard, local), name
            assert mine == placements or mine == (*placements, Replicate()), (name, mine, placements)
            assert float((got["after"][name] - want["after"][name]).abs().max()) <= 1e-6, name


def test_a_tp_module_computes_with_its_tp_dtensor_parameters_in_forward(ranks):
    for r in part(ranks, "train"):
        assert r["seen"]["up"] == ("DTensor", ("tp",), (Shard(0),), torch.float32, (tw.H, tw.D))
        assert r["seen"]["down"] == ("DTensor", ("tp",), (Shard(1),), torch.float32, (tw.D, tw.H))


def test_a_dcp_checkpoint_loads_into_a_fresh_sharded_model_exactly(ranks):
    """Saved after three steps, loaded into a model built from another seed: the same
    parameters and the same next step (loss and gradient norm) as the model that went on."""
    for r in part(ranks, "train"):
        assert r["loaded"] == 0.0
        _close(r["resumed"], r["continued"], 1e-6)


def test_full_state_dict_load_full_state_dict_and_full_parameters_see_the_unsharded_tensors(ranks):
    for r in part(ranks, "train"):
        assert r["full"] == 0.0  # full_state_dict: every parameter's full value, TP gathered too
        assert r["full_loaded"] == 0.0  # loaded into another sharded model
        inside, written = r["full_parameters"]
        assert inside == (tw.H, tw.D)  # the unsharded weight, not its TP piece
        assert written <= 1e-6  # a write inside lands in this rank's rows of its TP piece


def test_regions_issue_the_collectives_of_no_regions_and_gather_every_unit_again_in_backward(ranks):
    """A region records the block's TP all-reduce once and keeps it; zero's gathers it
    replays: backward gathers each unit (3 blocks and the root) again, as without regions,
    and between forward and backward no gathered buffer is alive, though autograd saved the
    DTensor weights made from them (each becomes a handle that gathers again)."""
    for counts in part(ranks, "collectives"):
        for regions in (True, False):
            forward, backward, held = counts[regions]
            gathers, all_reduce = "tracedac.all_gather.default", "_c10d_functional.all_reduce.default"
            assert forward == backward == {gathers: tw.BLOCKS + 1, all_reduce: tw.BLOCKS}, counts
            assert held == 0, counts


def test_mixed_precision_gathers_bf16_tp_weights_and_trains_as_autocast_would(ranks):
    """MixedPrecision() with TP: the weight a Linear computes with is a bf16 DTensor; the losses
    are those of the reference with its Linears under bf16 autocast, within bf16 rounding (a
    Rowwise layer sums its two partial products in bf16, the reference in one matmul)."""
    want = tw.reference(autocast=True)["losses"]
    for r in part(ranks, "mixed"):
        assert r["seen"] == ("DTensor", ("tp",), (Shard(0),), torch.bfloat16, (tw.H, tw.D))
        _close(r["losses"], want, 2e-3)


@pytest.mark.parametrize("case", tw.COMPILED, ids=lambda c: "-".join(map(str, c)))
def test_compiled_zero_with_tp_trains_as_eager_and_as_one_process(ranks, reference, case):
    """Blocks compiled one by one (torchtitan's order) or the whole model, with regions or
    without, aot_eager_decomp_partition or inductor: the losses, gradient norms and parameters
    of eager zero + TP and of one process on the whole batch. The norm is taken of the model
    ``torch.compile`` returned (``zero.clip_grad_norm_`` reads the model it compiled)."""
    eager = part(ranks, "train")
    for r, e in zip(part(ranks, "compiled"), eager, strict=True):
        got = r[case]
        _close(got["losses"], e["losses"], 1e-6)
        _close(got["norms"], e["norms"], 1e-6)
        _close(got["losses"], reference["losses"], 1e-5)
    params = part(ranks, "compiled")[0][case]["params"]  # full_state_dict of what was compiled
    assert params.keys() == reference["params"].keys()  # the model's keys: no "_orig_mod."
    for name, want in reference["params"].items():
        assert float((params[name] - want).abs().max()) <= 1e-5, name


def test_a_checkpoint_saved_from_the_compiled_model_loads_into_an_eager_one_exactly(ranks):
    """``save_checkpoint`` handed what ``torch.compile(model)`` returned writes the model's own
    keys: a fresh eager zero + TP model loads them and holds the trained parameters."""
    for r in part(ranks, "compiled"):
        assert r[tw.COMPILED[1]]["loaded"] == 0.0


@pytest.mark.parametrize(
    "case", [c for c in tw.COMPILED if c[2] != "inductor"], ids=lambda c: "-".join(map(str, c))
)
def test_compiled_zero_with_tp_gathers_again_in_backward_and_issues_each_all_reduce_once(ranks, case):
    """The graphs torch's partitioner made: every unit gathered in forward and again in
    backward, no gathered parameter (nor the DTensor weight made from it) saved for backward,
    and each block's TP all-reduce issued once, in forward, as eager zero + TP does (backward's
    all-reduces are the TP backward's own: as many as eager's backward issues)."""
    how = case[0]
    units = tw.BLOCKS if how == "per-block" else tw.BLOCKS + 1  # the root unit: compiled whole only
    eager_backward = part(ranks, "collectives")[0][True][1]["_c10d_functional.all_reduce.default"]
    for r in part(ranks, "compiled"):
        got = r[case]
        assert got["fw_gathers"] == got["bw_gathers"] == got["fw_releases"] == units, got
        assert got["saved_gathered"] == [], got
        assert got["fw_collectives"] == {"all_reduce": tw.BLOCKS}, got
        assert got["bw_collectives"] == {"all_reduce": eager_backward}, got


@pytest.mark.parametrize("mixed", ["mixed", "auto"])
def test_compiled_mixed_precision_with_tp_gathers_the_linears_in_bf16_and_trains_as_autocast(ranks, mixed):
    """MixedPrecision() and MixedPrecision("auto") compiled under bf16 autocast: the Linears'
    groups gathered in bf16 (the cast moved into the gather), the norms' in fp32, and the
    losses those of the reference with its Linears under autocast, within bf16 rounding."""
    want = tw.reference(autocast=True)["losses"]
    for r in part(ranks, "compiled"):
        got = r[mixed]
        linears, others = tw.BLOCKS, tw.BLOCKS  # per block: its Linears' group and its norm's
        assert got["gather_dtypes"] == ["torch.bfloat16"] * linears + ["torch.float32"] * others, got
        _close(got["losses"], want, 2e-3)


@pytest.mark.parametrize("regions", [True, False], ids=["regions", "no-regions"])
def test_auto_mixed_precision_with_tp_gathers_the_linears_in_bf16_as_the_program_reads_them(ranks, regions):
    """MixedPrecision("auto") with TP, eager under bf16 autocast: the first forward watches each
    gathered weight as the module reads it, a DTensor (or, inside a region, whose recorder
    leaves DTensor ops to DTensor, its local tensor), sees the Linears' weights cast to bf16
    and the norms' read in fp32, and decides so on every rank; the losses are the autocast
    reference's within bf16 rounding, and the wire carries bf16 from the second step."""
    want = tw.reference(autocast=True)["losses"]
    for r in part(ranks, "auto"):
        got = r[regions]
        linear = {k: v for k, v in got["dtypes"].items() if "Linear" in k}
        norm = {k: v for k, v in got["dtypes"].items() if "LayerNorm" in k}
        assert len(linear) == tw.BLOCKS + 1 and len(norm) == tw.BLOCKS, got["dtypes"]
        assert set(linear.values()) == {torch.bfloat16} and set(norm.values()) == {torch.float32}, got
        assert got["wire"].get("bfloat16", 0) > 0, got["wire"]
        _close(got["losses"], want, 2e-3)


def test_sharding_tp_parameters_over_the_whole_world_is_refused_on_every_rank_saying_what_to_do(ranks):
    """group=None with TP would mix TP's ranks into dp: ZeroError at the call, on every rank."""
    import re

    message = r"blocks\.0\.up\.weight.*no dimension is the process group.*\[0, 1, 2, 3\].*group=mesh"
    for r in part(ranks, "refusals"):
        assert r["world"] is not None and re.search(message, r["world"], re.S), r["world"]
