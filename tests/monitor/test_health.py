"""The routing-health monitor: layer statistics, the step accumulator, and one test per failure of
the symptom map, provoked on a small MoE layer over synthetic steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.config import MoEConfig, RouterConfig
from dropless.layers.moe import MoELayer
from dropless.monitor import stats
from dropless.monitor.alarms import AlarmThresholds, HealthMonitor, load_excess
from host_sync import forbid_host_sync
from tolerances import assert_close


def build(E: int = 6, K: int = 2, bias: list[float] | None = None, seed: int = 0, align: int = 1) -> MoELayer:
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=E, top_k=K, d_expert=8, align=align,
                    router=RouterConfig(use_expert_bias=bias is not None))
    layer = MoELayer(16, cfg)
    if bias is not None:
        layer.router.expert_bias.copy_(torch.tensor(bias))
    return layer


def train_like(layer: MoELayer, run_dir: Path, steps: int = 4, micro: int = 2, T: int = 48) -> list[str]:
    """What the trainer does (docs/monitoring.md), without the optimizer. Returns the alarm kinds."""
    E, K = layer.cfg.num_experts, layer.cfg.top_k
    acc = stats.StepAccumulator(1, E, K)
    monitor = HealthMonitor(run_dir, echo=False)
    g = torch.Generator().manual_seed(7)
    probe = torch.randn(32, 16, generator=g)
    prev_ids = None
    kinds = []
    for step in range(steps):
        layer.detailed_stats = True  # every step is a log step here
        for _ in range(micro):
            out = layer(torch.randn(T, 16, generator=g))
            acc.add(0, out.stats, out.aux_loss)
        acc.end_step()
        ids = layer.router(probe).ids_TK
        flip = stats.flip_rate(prev_ids, ids, num_experts=E) if prev_ids is not None else None
        prev_ids = ids
        row = acc.record(step, flip_bf16=[stats.bf16_flip_rate(layer.router, probe)], flip_step=[flip],
                         bias=[layer.router.expert_bias])
        with (run_dir / "routing.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        kinds += [a.kind for a in monitor.check(row)]
    return kinds


def test_healthy_layer_raises_no_alarm(tmp_path: Path) -> None:
    assert train_like(build(E=4, K=2), tmp_path) == []
    assert not (tmp_path / "health.jsonl").exists()


def test_collapsed_router_is_flagged(tmp_path: Path) -> None:
    kinds = train_like(build(E=6, K=1, bias=[10.0, 0, 0, 0, 0, 0]), tmp_path)
    assert "collapse" in kinds
    alarm = json.loads((tmp_path / "health.jsonl").read_text().splitlines()[0])
    assert alarm["kind"] == "collapse" and alarm["metric"] == "maxvio_global_mean"
    assert alarm["value"] == pytest.approx(5.0) and alarm["layer"] == 0 and alarm["step"] == 0
    assert "aux_loss_coeff" in alarm["action"]


def test_dead_expert_is_flagged_after_the_window(tmp_path: Path) -> None:
    kinds = train_like(build(E=6, K=2, bias=[0, 0, -100.0, 0, 0, 0]), tmp_path, steps=4)
    assert kinds == ["dead_expert"]
    alarms = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert alarms[0]["expert"] == 2 and alarms[0]["step"] == 2  # third interval without tokens


def test_rogue_expert_is_flagged(tmp_path: Path) -> None:
    layer = build(E=6, K=2)
    with torch.no_grad():
        layer.experts.w_down_EFD[3] *= 1000.0
    kinds = train_like(layer, tmp_path, steps=1)
    assert kinds == ["rogue_expert"]
    row = json.loads((tmp_path / "routing.jsonl").read_text())
    assert 300 < row["layers"][0]["rms_max_over_median"] < 3000


def test_dying_expert_is_flagged(tmp_path: Path) -> None:
    layer = build(E=6, K=2)
    with torch.no_grad():
        layer.experts.w_down_EFD[1] *= 1e-5
    assert train_like(layer, tmp_path, steps=1) == ["dying_expert"]


def test_flat_probabilities_with_skewed_loads_fool_the_aux_loss_not_the_monitor(tmp_path: Path) -> None:
    # A zero router gives probabilities exactly 1/E: the aux loss reads its minimum 1.0, while the
    # tie-break sends every token to experts 0 and 1.
    layer = build(E=6, K=2)
    with torch.no_grad():
        layer.router.weight.zero_()
    out = layer(torch.randn(32, 16))
    assert float(out.aux_loss.detach()) == pytest.approx(1.0)
    kinds = train_like(layer, tmp_path, steps=3)
    assert "aux_blind" in kinds and "collapse" in kinds


def test_bias_drift_and_drops_on_synthetic_rows(tmp_path: Path) -> None:
    mon = HealthMonitor(tmp_path, echo=False)
    kinds = []
    for step, b in enumerate([0.5, 1.2, 1.5, 1.9, 2.4]):
        row = {"counts": [4, 4, 4, 4], "maxvio_global": 0.0, "bias_abs_max": b, "dropped": 3 if step == 4 else 0}
        kinds += [a.kind for a in mon.check({"step": step, "layers": [row]})]
    assert kinds == ["bias_drift", "dropped"]  # once per (layer, kind), though drift fires every step


def test_detailed_stats_values_and_default_cost() -> None:
    layer = build(E=5, K=2)
    x = torch.randn(30, 16)
    plain = layer(x).stats
    assert plain.out_sq_E is None and plain.router_entropy is None and plain.top1_top2_ratio is None
    layer.detailed_stats = True
    s = layer(x).stats
    # out_sq_E against a per-expert recomputation
    d = layer.router(x)
    ex = layer.experts
    expected = torch.zeros(5)
    for t in range(30):
        for j in range(2):
            e = int(d.ids_TK[t, j])
            h = torch.nn.functional.silu(x[t] @ ex.w_gate_up_EDF[e][:, :8]) * (x[t] @ ex.w_gate_up_EDF[e][:, 8:])
            expected[e] += (h @ ex.w_down_EFD[e]).square().mean()
    assert_close(s.out_sq_E, expected.detach(), msg="out_sq_E")
    p = d.scores_TE
    assert_close(s.router_entropy, -(p * p.log()).sum(-1).mean().detach(), msg="entropy")
    top = p.topk(2, -1).values
    assert_close(s.top1_top2_ratio, (top[:, 0] / top[:, 1]).mean().detach(), msg="top1/top2")


def test_detailed_stats_need_no_host_sync() -> None:
    # With padded groups (align=4, set in the config: the dispatcher takes its alignment when the
    # layer is built), so the per-expert output sums skip padding rows without reading a count.
    layer = build(E=5, K=2, align=4)
    layer.detailed_stats = True
    seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(args[0].offsets_E))
    acc = stats.StepAccumulator(1, 5, 2)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(3))
    with forbid_host_sync():
        out = layer(x)
        acc.add(0, out.stats, out.aux_loss)
        acc.end_step()
    assert acc.record(0)["layers"][0]["rms_max_over_median"] is not None
    # the padding really exists: each group is padded to a multiple of 4, and some groups grew
    counts = out.stats.tokens_per_expert_E
    padded = (counts + 3) // 4 * 4
    assert torch.equal(seen[0].long(), torch.cumsum(padded, 0))
    assert not torch.equal(seen[0].long(), torch.cumsum(counts, 0))
    # and the padded sums are the per-expert sums of the unpadded layer (same weights)
    plain = build(E=5, K=2)
    plain.load_state_dict(layer.state_dict())
    plain.detailed_stats = True
    assert_close(out.stats.out_sq_E, plain(x).stats.out_sq_E, msg="out_sq_E padded vs unpadded")


def test_maxvio_local_catches_what_global_hides() -> None:
    acc = stats.StepAccumulator(1, 2, 1)
    Stats = type(build(E=2, K=1)(torch.randn(2, 16)).stats)
    z = torch.zeros((), dtype=torch.int64)
    for counts in ([10, 0], [0, 10]):  # each micro-batch on one expert; the step is balanced
        acc.add(0, Stats(torch.tensor(counts), z + 10, z))
    acc.end_step()
    row = acc.record(5)["layers"][0]
    assert row["maxvio_local"] == 1.0 and row["maxvio_global"] == 0.0 and row["counts"] == [10, 10]
    assert acc.record(6)["layers"][0]["counts"] == [0, 0]  # record resets the interval


def test_interval_means_of_global_maxvio_leave_out_skipped_steps() -> None:
    """The record's per-layer `maxvio_global_mean` and `maxvio_worst_mean` (the worst layer of each
    step, averaged) are means over the interval's applied steps; the max stays the worst step."""
    acc = stats.StepAccumulator(2, 2, 1)
    Stats = type(build(E=2, K=1)(torch.randn(2, 16)).stats)
    z = torch.zeros((), dtype=torch.int64)
    # per step (layer 0, layer 1) global MaxVio: (1, 0), (0, 0.5), then a skipped step (1, 1)
    steps = [([2, 0], [1, 1], False), ([1, 1], [3, 1], False), ([2, 0], [2, 0], True)]
    for c0, c1, skip in steps:
        acc.begin_step()
        acc.add(0, Stats(torch.tensor(c0), z + 2, z))
        acc.add(1, Stats(torch.tensor(c1), z + 2, z))
        acc.end_step(skip=torch.tensor(skip))
    row = acc.record(3)
    (l0, l1) = row["layers"]
    assert (l0["maxvio_global"], l1["maxvio_global"]) == (1.0, 0.5)
    assert (l0["maxvio_global_mean"], l1["maxvio_global_mean"]) == (0.5, 0.25)
    assert row["maxvio_worst_mean"] == 0.75 and row["skipped_steps"] == 1  # (1 + 0.5) / 2
    empty = acc.record(4)
    assert empty["maxvio_worst_mean"] is None and empty["layers"][0]["maxvio_global_mean"] is None


def test_interval_means_survive_a_resume_and_old_checkpoints_load() -> None:
    Stats = type(build(E=2, K=1)(torch.randn(2, 16)).stats)
    z = torch.zeros((), dtype=torch.int64)

    def step(acc: stats.StepAccumulator, counts: list[int]) -> None:
        acc.add(0, Stats(torch.tensor(counts), z + 2, z))
        acc.end_step()

    whole, first = stats.StepAccumulator(1, 2, 1), stats.StepAccumulator(1, 2, 1)
    for acc in (whole, first):
        step(acc, [2, 0])
    resumed = stats.StepAccumulator(1, 2, 1)
    resumed.load_state_dict(first.state_dict())
    for acc in (whole, resumed):
        step(acc, [1, 1])
    assert resumed.record(2) == whole.record(2)
    old = {k: v for k, v in first.state_dict().items() if k not in stats.MEAN_SUMS}
    resumed.load_state_dict(old)  # written before the means existed: they cover the steps after it
    step(resumed, [1, 1])
    row = resumed.record(3)
    assert row["layers"][0]["counts"] == [3, 1] and row["maxvio_worst_mean"] == 0.0
    with pytest.raises(ValueError, match="counts_LE"):
        resumed.load_state_dict({k: v for k, v in old.items() if k != "counts_LE"})


def test_flip_rates() -> None:
    a = torch.tensor([[0, 1], [2, 3], [1, 2]])
    b = torch.tensor([[1, 0], [2, 0], [1, 2]])  # slot order ignored; one of three tokens changed
    assert float(stats.flip_rate(a, b, num_experts=4)) == pytest.approx(1 / 3)
    # bf16 keeps 8 mantissa bits (spacing u = 2^-7 just above 1). Expert 0 scores x0 + x2, expert 1
    # x1 + x3. In fp32 expert 1 wins (2 + 1.3u vs 2 + 1.2u); rounding the inputs to bf16 moves x0, x2
    # up to 1 + u and x1 down to 1, so in bf16 expert 0 wins (2 + 2u vs 2 + u): every token flips.
    u = 2.0 ** -7
    torch.manual_seed(0)
    router = MoELayer(4, MoEConfig(num_experts=4, top_k=1, d_expert=8)).router
    w = torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 1], [-1, 0, 0, 0], [0, 0, 0, -1]])
    with torch.no_grad():
        router.weight.copy_(w)
    x = torch.tensor([[1 + 0.6 * u, 1 + 0.4 * u, 1 + 0.6 * u, 1 + 0.9 * u]]).repeat(8, 1)
    assert float(stats.bf16_flip_rate(router, x)) == 1.0
    with torch.no_grad():
        router.weight[1] = torch.tensor([0.0, 1, 0, 0])  # expert 1 far behind: no flip
    assert float(stats.bf16_flip_rate(router, x)) == 0.0


def test_balance_alarms_wait_for_warmup_but_drops_do_not() -> None:
    from dropless.monitor.alarms import AlarmThresholds, HealthMonitor

    row = {"counts": [100, 0, 0, 0], "maxvio_global": 3.0, "top_k": 1, "dropped": 5}
    early = HealthMonitor(echo=False, thresholds=AlarmThresholds(warmup_steps=50))
    kinds = {a.kind for a in early.check({"step": 9, "layers": [row]})}
    assert kinds == {"dropped"}  # a collapse at step 9 of warm-up is a transient; a drop never is
    kinds = {a.kind for a in early.check({"step": 60, "layers": [row]})}
    assert "collapse" in kinds


DEFAULT_RUN = Path(__file__).parent / "data" / "default_run_routing.jsonl"


def _default_run_rows() -> list[dict]:
    # routing.jsonl of `dropless train` on the tiny preset (600 steps, seed 0, 2-core CPU, fp32), cut to
    # the fields the balance rules read; its learning-rate warm-up is 50 steps
    return [json.loads(line) for line in DEFAULT_RUN.read_text().splitlines()]


def test_the_default_run_raises_no_false_alarm() -> None:
    rows = _default_run_rows()
    after = [(r["step"], layer) for r in rows for layer in r["layers"] if r["step"] >= 50]
    # what the rules used to read: the worst single step crossed the collapse threshold after the
    # warm-up, and the aux loss sat within 0.05 of 1 while the worst step's MaxVio was above 1
    assert any(layer["maxvio_global"] > 2.0 for _, layer in after)
    assert any(abs(layer["aux_loss"] - 1) < 0.05 and layer["maxvio_global"] > 1.0 for _, layer in after)
    monitor = HealthMonitor(None, AlarmThresholds(warmup_steps=50), echo=False)
    assert [a for r in rows for a in monitor.check(r)] == []


def test_a_flat_router_on_the_default_runs_loads_is_caught() -> None:
    # the same loads with the aux loss a flat router reads (E * sum f / E = 1): aux_blind, where the
    # interval's mean MaxVio is above 1
    rows = _default_run_rows()
    for r in rows:
        for layer in r["layers"]:
            layer["aux_loss"] = 1.0 + 1e-4
    monitor = HealthMonitor(None, AlarmThresholds(warmup_steps=50), echo=False)
    fired = [(a.kind, a.step) for r in rows for a in monitor.check(r)]
    assert fired and {k for k, _ in fired} == {"aux_blind"}
    assert all(s >= 50 for _, s in fired)


def test_load_excess_is_what_the_aux_loss_reads_when_probabilities_follow_the_loads() -> None:
    counts = [7, 1, 0, 4, 4]
    f = torch.tensor(counts, dtype=torch.float64) / sum(counts)
    assert load_excess(counts) == pytest.approx(float(len(counts) * (f * f).sum() - 1))
    assert load_excess([3, 3, 3]) == pytest.approx(0.0) and load_excess([0, 0]) == 0.0


@pytest.mark.parametrize("follows, fires", [(0.5, False), (0.05, True)])
def test_aux_blind_reads_the_aux_loss_against_the_loads_own_excess(follows: float, fires: bool) -> None:
    # 16 experts, one at 2.1x its share (MaxVio 1.1): a router whose probabilities follow half of the
    # loads' skew reads aux = 1.04, within the old fixed 0.05 of 1, and is healthy; one that follows
    # 5% of it is flat
    counts = [2100] + [993] * 15
    excess = load_excess(counts)
    row = {"counts": counts, "maxvio_global": 1.3, "maxvio_global_mean": 1.1, "top_k": 2,
           "aux_loss": 1.0 + follows * excess}
    kinds = [a.kind for a in HealthMonitor(None, echo=False).check({"step": 0, "layers": [row]})]
    assert kinds == (["aux_blind"] if fires else [])
