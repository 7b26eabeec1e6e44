"""The saved-tensor report: what is kept, how big, from where, why; what replay costs."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import tracedac
from tracedac import checkpoint, policies, print_saved, saved_report
from tracedac.record.graph import human_bytes


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(256)
        self.fc = nn.Linear(256, 1024)
        self.proj = nn.Linear(1024, 256)

    def forward(self, x):  # [B, T, 256]
        h = F.gelu(self.fc(self.ln(x)))  # [B, T, 1024]
        tracedac.name(h, "act")
        return x + self.proj(h)


def test_bytes_read_in_human_units():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(1 << 20) == "1.00 MiB"
    assert human_bytes(3 << 30) == "3.00 GiB"


def test_the_report_lists_what_each_policy_keeps_with_its_size_place_and_reason():
    mlp = MLP()
    x = torch.randn(2, 128, 256, requires_grad=True)
    nothing = saved_report(mlp, x)
    assert not [r for r in nothing.rows if r.kind == "activation"] and nothing.kept_bytes == 0
    assert {r.why.split(":")[0].split(" of shape")[0] for r in nothing.rows} >= {
        "argument 0",
        "parameter 'fc.weight'",
    }

    matmuls = saved_report(mlp, x, policy=policies.save_matmuls())
    (row,) = [r for r in matmuls.rows if r.kind == "activation"]
    assert row.op == "aten.addmm.default" and row.shape == (2, 128, 1024) and row.dtype == torch.float32
    assert row.bytes == 1 << 20 and row.module == "fc" and row.why == "save_matmuls() -> MUST_SAVE"
    assert row.source.endswith(f"test_inspect.py:{MLP.forward.__code__.co_firstlineno + 1}")

    named = saved_report(mlp, x, policy=policies.save_names("act"))
    (row,) = [r for r in named.rows if r.kind == "activation"]
    assert row.op == "aten.gelu.default" and row.label == "act" and row.module == "MLP"
    assert matmuls.replayed_bytes < nothing.replayed_bytes


def test_reported_replay_flops_are_what_backward_spends_beyond_eager():
    """Counted by torch's FlopCounterMode, outside tracedac."""
    mlp = MLP()
    x = torch.randn(2, 128, 256, requires_grad=True)

    def backward_flops(module):
        loss = module(x).sum()
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return counter.get_total_flops()

    eager = backward_flops(mlp)
    for policy in (policies.recompute_all(), policies.save_matmuls()):
        report = saved_report(mlp, x, policy=policy)
        replayed = backward_flops(checkpoint(MLP(), policy=policy)) - eager
        assert report.replay_flops == replayed, policy
    assert report.replay_flops == 0 and report.replay_ops == 2  # layer norm and gelu, no matmul


def test_a_checkpointed_module_is_reported_under_its_own_policy_unless_told_otherwise():
    mlp = checkpoint(MLP(), policy=policies.save_matmuls())
    x = torch.randn(2, 8, 256, requires_grad=True)
    assert [r.op for r in saved_report(mlp, x).rows if r.kind == "activation"] == ["aten.addmm.default"]
    assert not [
        r for r in saved_report(mlp, x, policy=policies.recompute_all()).rows if r.kind == "activation"
    ]
    assert mlp._tracedac.policy == policies.save_matmuls(), "the override does not stick"


def test_a_model_whose_blocks_are_checkpointed_is_reported_as_it_runs():
    """``tracedac.wrap(model, Block)`` then ``saved_report(model, x)``: the blocks' regions,
    not one more region around the model (which recomputed everything between the blocks and
    counted the blocks' replay twice: the bench's eager row read 17.2 GFLOP for 7.5 replayed).
    Replay counted by torch's FlopCounterMode, outside tracedac."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(256, 256)
            self.blocks = nn.ModuleList([MLP(), MLP()])

        def forward(self, x):
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    plain, model = Model(), Model()
    model.load_state_dict(plain.state_dict())
    tracedac.wrap(model, MLP, policy=policies.recompute_all())
    x = torch.randn(2, 16, 256, requires_grad=True)

    def flops(m):
        with FlopCounterMode(display=False) as counter:
            m(x).sum().backward()
        return counter.get_total_flops()

    report = saved_report(model, x)
    assert {r.region for r in report.rows} == {"blocks.0", "blocks.1"}
    assert report.replay_flops == flops(model) - flops(plain) > 0
    # with a policy, the model is one region under it, as before
    whole = saved_report(model, x, policy=policies.recompute_all())
    assert "Model" in {r.region for r in whole.rows}


def test_nested_regions_and_copies_of_written_inputs_are_reported():
    inner = checkpoint(lambda h: h.sin().square(), policy=policies.save_all())

    def outer(x, buf):
        y = (x * buf).sin()
        buf.add_(1)
        return inner(y).sum()

    report = saved_report(outer, torch.randn(64, requires_grad=True), torch.zeros(64))
    kinds = {(r.region.split(".")[-1], r.kind) for r in report.rows}
    assert ("<lambda>", "activation") in kinds and ("outer", "snapshot") in kinds
    snapshot = next(r for r in report.rows if r.kind == "snapshot")
    assert snapshot.op == "aten.add_.Tensor" and snapshot.bytes == 256


def test_print_saved_prints_a_table_and_totals(capsys):
    report = print_saved(MLP(), torch.randn(2, 8, 256, requires_grad=True), policy=policies.save_matmuls())
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == [
        "region",
        "kind",
        "op",
        "shape",
        "dtype",
        "bytes",
        "source",
        "module",
        "label",
        "why",
    ]
    assert "aten.addmm.default  2x8x1024  float32  64.00 KiB" in text
    assert f"kept {human_bytes(report.kept_bytes)}" in text and "replayed in backward" in text


def test_a_wrapped_models_report_names_each_region_and_parameters_by_their_full_names(capsys):
    """Blocks of one class keep the same rows: the region column tells them apart, and a
    parameter is named as ``model.named_parameters()`` names it (what a person searches for)."""
    model = nn.Sequential(MLP(), MLP())
    tracedac.wrap(model, MLP)
    report = print_saved(model, torch.randn(2, 8, 256, requires_grad=True))
    lines = capsys.readouterr().out.splitlines()
    assert {r.region for r in report.rows} == {"0", "1"}
    assert {line.split()[0] for line in lines[2:] if line and not line.startswith("kept")} == {"0", "1"}
    names = {r.why.split(" of shape")[0] for r in report.rows if r.kind == "input"}
    assert {"parameter '0.fc.weight'", "parameter '1.fc.weight'"} <= names, names
