"""`dropless plan` with pipeline stages: which rank holds what, the micro-batches each schedule keeps
alive (read from torch's own schedules), every rank's bytes against a real pipelined step, and the
knobs the planner offers for stages."""

from __future__ import annotations

import pytest

from dropless.pipeline_config import PipelineSpec
from dropless.plan import cli
from dropless.plan import pipeline as pplan
from dropless.plan.activations import activation_bytes
from dropless.plan.model import _meta_model, plan, plan_ranks
from dropless.plan.suggest import knob_overrides
from plan_cases import config, one_thread  # noqa: F401  (one_thread: an autouse fixture)

SMALL = ["model.n_layers=4", "train.batch_size=4", "train.seq_len=64", "model.max_seq_len=64",
         "train.optimizer=adamw"]


def small(*extra: str, dtype: str = "fp32"):
    return config(SMALL, *extra, dtype=dtype)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_one_f_one_b_and_gpipe_in_flight(p: int, m: int) -> None:
    """1F1B keeps min(m, p - rank) micro-batches (its warm-up forwards), GPipe all m; every forward
    has its backward, in order."""
    for r in range(p):
        one = PipelineSpec(pp_size=p, schedule="1f1b", microbatches=m)
        assert pplan.in_flight(one, r, {r: 1}) == (min(m, p - r), {r: min(m, p - r)})
        gpipe = PipelineSpec(pp_size=p, schedule="gpipe", microbatches=m)
        assert pplan.in_flight(gpipe, r, {r: 1})[0] == m
        acts = pplan.actions(one, r)
        assert [i for k, _, i in acts if k == "F"] == list(range(m))
        assert [i for k, _, i in acts if k == "B"] == list(range(m))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 8)])
def test_interleaved_in_flight_is_megatrons_warm_up(p: int, v: int, m: int) -> None:
    """Interleaved 1F1B, walked from torch's own pipeline_order: rank r holds (v - 1) p +
    2 (p - 1 - r) + 1 chunks at its peak (Megatron's warm-up count plus the steady state's one),
    capped at all of them."""
    spec = PipelineSpec(pp_size=p, schedule="interleaved_1f1b", microbatches=m, stages_per_rank=v)
    for r in range(p):
        peak, alive = pplan.in_flight(spec, r, {s: 1 for s in spec.stages_of(r)})
        assert peak == min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m) == sum(alive.values())


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
def test_zero_bubble_frees_at_the_weight_gradient(schedule: str) -> None:
    """The split backward frees a micro-batch at its weight gradient (W), not its input gradient (I):
    every forward is released once, and counting I as the release would hold fewer on the
    interleaved zero-bubble schedule's later ranks (zbv runs each W right after its I)."""
    spec = PipelineSpec(pp_size=4, schedule=schedule, microbatches=8, stages_per_rank=2)
    lower = []
    for r in range(4):
        acts = pplan.actions(spec, r)
        assert {k for k, _, _ in acts} == {"F", "I", "W"}
        assert sum(k == "F" for k, _, _ in acts) == sum(k == "W" for k, _, _ in acts) == 16
        peak, _ = pplan.in_flight(spec, r, {s: 1 for s in spec.stages_of(r)})
        alive = low = 0
        for k, _, _ in acts:  # releasing at I instead
            alive += {"F": 1, "I": -1, "W": 0}[k]
            low = max(low, alive)
        assert peak >= low
        lower.append(low < peak)
    assert any(lower) == (schedule == "zero_bubble")


@pytest.mark.parametrize("tied,mtp", [(False, 0), (True, 0), (False, 1)])
def test_ranks_hold_the_whole_model_once(tied: bool, mtp: int) -> None:
    """Summed over the pipeline's ranks at one rank per stage, the parameters are the whole model's
    (the MTP modules on the last), the embedding once more where the last stage keeps a copy (tied,
    or for MTP); each block on one rank, in order."""
    over = (f"model.tie_embeddings={str(tied).lower()}", f"model.mtp_depth={mtp}")
    cfg = small("parallel.pp_size=2", *over)
    whole = plan(small(*over), 1)
    ranks = plan_ranks(cfg, 2)
    embed = _meta_model(cfg).embed.weight.numel() * 4
    assert sum(r.params for r in ranks) == whole.params + (embed if tied or mtp else 0)
    assert [r.stages for r in ranks] == [(0,), (1,)] and sum(r.blocks for r in ranks) == 4


def test_rank_activations_are_its_stages_times_in_flight() -> None:
    """pp 2, 1F1B, 4 micro-batches: rank 0 keeps 2 micro-batches of its blocks and its output, rank 1
    one of its blocks and the head; the loss's gradient only on the last; receive buffers per
    micro-batch (input on rank 1, output gradient on rank 0)."""
    cfg = small("parallel.pp_size=2", "parallel.pp_microbatches=4")
    spec = cfg.parallel.pipeline
    model = _meta_model(cfg)
    shapes = pplan.ranks(spec, model, 64)
    a = activation_bytes(cfg.model, 1, 64, False)
    out = 1 * 64 * cfg.model.d_model * 4

    def blocks(ids):
        return sum(a.moe_block if model.blocks[i].is_moe else a.dense_block for i in ids)

    r0, r1 = plan_ranks(cfg, 2)
    assert r0.activations == 2 * (blocks(shapes[0].blocks[0]) + out)
    assert r1.activations == blocks(shapes[1].blocks[0]) + a.head
    assert r0.loss_grad == 0 and r1.loss_grad > 0
    assert r0.pp_buffers == r1.pp_buffers == 4 * out
    assert plan(cfg, 2) == max(r0, r1, key=lambda r: r.peak)


def test_pipeline_flag_is_pp_size_and_refusals_name_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.parser().parse_args(["tiny", "--world", "4", "--pipeline", "2"])
    cfg, _ = cli.build(args)
    assert cfg.parallel.pp_size == 2
    assert cli.main(["tiny", "--world", "4", "--pipeline", "2", "--set", "parallel.ep_size=2"]) == 0
    out = capsys.readouterr().out
    assert "pp 2 x ep 2" in out and "pp rank" in out and "in flight" in out
    assert cli.main(["tiny", "--world", "8", "--set", "parallel.pp_size=8"]) == 2
    assert "parallel.pp_size" in capsys.readouterr().err
    assert cli.main(["tiny", "--world", "6", "--set", "parallel.pp_size=2", "--set", "parallel.ep_size=2"]) == 2
    assert "--world 6" in capsys.readouterr().err


def test_knobs_for_stages_are_valid_configs() -> None:
    """More pipeline ranks where the world allows, more micro-batches per call, and fewer per call
    with more calls (the same tokens per step): each a config the trainer accepts and the planner
    plans lower where it should."""
    cfg = small("parallel.pp_size=2", "train.batch_size=8", "parallel.pp_microbatches=4")
    knobs = dict((k, o) for k, o in reversed(knob_overrides(cfg, 8)))
    assert knobs["pp_size"] == ["parallel.pp_size=4"]
    assert knobs["pp_microbatches"] == ["parallel.pp_microbatches=8"]
    assert knobs["pp_calls"] == ["train.batch_size=4", "parallel.pp_microbatches=2", "train.grad_accum=2"]
    base = plan(cfg, 8)
    calls = plan(config(SMALL, "parallel.pp_size=2", *knobs["pp_calls"], dtype="fp32"), 8)
    assert calls.pp_buffers < base.pp_buffers and calls.tokens == base.tokens
    assert "pp_size" not in dict(knob_overrides(small(), 1))


@pytest.mark.slow
def test_every_rank_against_a_real_pipelined_step() -> None:
    """pp 2 on two gloo processes, the trainer's Pipeline and optimizer: every rank's states and
    receive buffers to the byte, its activations (the most alive at once over the schedule) within
    10%. Counting one micro-batch in flight on rank 0, or no receive buffers, breaks it."""
    from dropless.plan.validate_pipeline import measured_by_pp_rank

    cfg = config(["train.optimizer=adamw"], "parallel.pp_size=2", dtype="bf16")
    measured = measured_by_pp_rank(cfg, 2, steps=1)
    for p in plan_ranks(cfg, 2):
        m = measured[p.pp_rank]
        for comp in ("params", "grads", "optimizer", "pp_buffers"):
            assert getattr(p, comp) == m[comp], (p.pp_rank, comp)
        assert abs(p.activations / m["activations"] - 1) < 0.1, (p.pp_rank, p.activations, m["activations"])
