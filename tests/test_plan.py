"""`dropless plan`: each predicted component against the bytes of a real model's tensors (world 1),
the units, the CLI's errors and output, and the suggestions.

The measurement side is dropless.plan.validate.measure: the trainer's build and one real step,
counted from live storages (not the planner's fake-tensor count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.config import load_config
from dropless.plan import cli
from dropless.plan.model import plan, with_overrides
from dropless.plan.suggest import suggest
from dropless.plan.validate import measure
from dropless.train.run import preset_path

SMALL = ["model.n_layers=3", "train.batch_size=4", "train.seq_len=64", "model.max_seq_len=64"]


def small(*extra: str, dtype: str = "fp32"):
    return load_config(preset_path("tiny"), [*SMALL, f"train.dtype={dtype}", *extra])


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_parse_bytes_units_and_errors() -> None:
    assert cli.parse_bytes("--device-memory", "80GiB") == 80 * 2**30
    assert cli.parse_bytes("--device-memory", "80GB") == 80 * 10**9
    assert cli.parse_bytes("--device-memory", "1.5KiB") == 1536
    assert cli.parse_bytes("--device-memory", "123") == 123
    assert cli.parse_bytes("--device-memory", "123B") == 123
    for bad in ("80gb", "80Gb", "80 GiBs", "-1GB", "GB", "0", "1.5B", ""):
        with pytest.raises(ValueError, match="--device-memory"):
            cli.parse_bytes("--device-memory", bad)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bf16"])
def test_states_equal_the_real_tensors(optimizer: str) -> None:
    """params, grads and optimizer state at world 1: the planner's figure is the real storages'
    bytes exactly (a parameter left out, a wrong moment width or a tied weight counted twice
    breaks it)."""
    cfg = small(f"train.optimizer={optimizer}", "model.moe.n_shared_experts=1")
    measured = measure(cfg, steps=1, distributed=False)
    p = plan(cfg, 1)
    for comp in ("params", "grads", "optimizer"):
        assert getattr(p, comp) == measured[comp], comp
    assert p.ep_buffers == measured["ep_buffers"] == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ['[]', '["layer"]', '["moe"]', '["attn","norm","moe"]',
                                       '["shared_experts"]', '["norm"]'])
def test_activations_match_what_the_forward_leaves_alive(dtype: str, recompute: str) -> None:
    """The fake-tensor count (saved tensors + checkpoint inputs + held outputs) against the
    storages a real forward leaves alive. Within 2%: at world 1 they agree to a few hundred bytes;
    forgetting a checkpoint's inputs (the MoE layer's normed input under `moe`) or the MoE outputs
    the model holds costs more than that."""
    cfg = small(f"model.recompute={recompute}", "model.moe.n_shared_experts=1", dtype=dtype)
    measured = measure(cfg, steps=1, distributed=False)["activations"]
    predicted = plan(cfg, 1).activations
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)


def test_recompute_orders_the_activations() -> None:
    acts = {r: plan(small(f"model.recompute={r}"), 1).activations
            for r in ('[]', '["layer"]', '["moe"]', '["attn"]', '["norm"]')}
    assert acts['["layer"]'] < acts['["moe"]'] < acts["[]"]
    assert acts['["attn"]'] < acts["[]"] and acts['["norm"]'] < acts["[]"]


def test_world_shards_states_and_ep_sizes_buffers() -> None:
    cfg = small()
    one, four = plan(cfg, 1), plan(cfg, 4)
    assert four.params < one.params / 3.5 and four.optimizer < one.optimizer / 3.5
    # world > 1 always has an EP dispatcher (over a group of one here): buffers, same activations
    assert four.activations == one.activations and four.ep_buffers > 0 == one.ep_buffers
    assert four.fsdp_gather > 0 == one.fsdp_gather
    ep = plan(with_overrides(cfg, ["parallel.ep_size=2", "parallel.ep_mode=buffered"]), 2)
    assert ep.ep_buffers > 0
    factor4 = plan(with_overrides(cfg, ["parallel.ep_size=2", "parallel.ep_mode=buffered",
                                        "parallel.ragged_buffer_factor=0.5"]), 2)
    assert factor4.ep_buffers < ep.ep_buffers and factor4.activations < ep.activations


def test_suggestions_are_replans_and_fit() -> None:
    # grad_accum 2 already: halving the micro-batch then keeps the gradients it already held
    cfg = small("train.grad_accum=2")
    p = plan(cfg, 1)
    device = p.peak - p.activations // 3  # too small by a third of the activations
    shown, combined = suggest(cfg, 1, device)
    assert combined is None
    fitting = [s for s in shown if s.fits]
    assert {s.knob for s in fitting} >= {"recompute", "micro_batch"}
    for s in shown:
        if s.peak is not None:
            assert s.peak == plan(with_overrides(cfg, list(s.overrides)), 1).peak
            assert s.fits == (s.peak <= device)
    shown, combined = suggest(cfg, 1, p.params * 3)  # nothing alone fits: a combination
    assert combined is not None and len(combined.overrides) >= 2


def test_cli_table_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    args = ["tiny", *sum((["--set", s] for s in SMALL), []), "--device-memory", "1MiB", "--json", str(out)]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "micro_batch" in text and "model.offload" in text
    data = json.loads(out.read_text())
    assert data["fits"] is False and data["plan"]["peak"] == plan(small(dtype="auto"), 1).peak
    bad = tmp_path / "bad.json"
    for argv, flag in ((["tiny", "--device-memory", "80gb"], "--device-memory"),
                       (["tiny", "--world", "3", "--set", "parallel.ep_size=2"], "--world"),
                       (["tiny", "--micro-batch-tokens", "100"], "--micro-batch-tokens"),
                       (["tiny", "--set", "model.moe.top_k=99"], "model.moe.top_k")):
        assert cli.main([*argv, "--json", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dropless plan: error:") and flag in err
        assert not bad.exists()


def test_micro_batch_tokens_flag() -> None:
    args = cli.parser().parse_args(["tiny", "--micro-batch-tokens", "1024"])
    cfg, _, _ = cli.build(args)
    assert cfg.train.batch_size * cfg.train.seq_len == 1024


@pytest.mark.slow
def test_world_two_expert_parallel_components() -> None:
    """FSDP2 + EP 2 (buffered) on two gloo processes: sharded states exactly, EP buffers to the
    byte of what the all-to-alls allocate, activations within 10% (the EP dispatcher's own index
    tensors are not in the planner's substitution)."""
    from dropless.plan.validate import measured_max

    cfg = small("parallel.ep_size=2", "parallel.ep_mode=buffered")
    measured = measured_max(cfg, 2, steps=1)
    p = plan(cfg, 2)
    for comp in ("params", "grads", "optimizer"):
        assert getattr(p, comp) == measured[comp], comp
    assert abs(p.ep_buffers / measured["ep_buffers"] - 1) < 0.001
    assert abs(p.activations / measured["activations"] - 1) < 0.10


def test_pipeline_fold_is_one_heavy_stage() -> None:
    """--pipeline P: ceil(n_layers / P) blocks (MoE ones first) on world / P ranks, the blocks'
    activations of P micro-batches and the head's of one."""
    cfg = small("model.n_layers=5", "model.n_dense_layers=1")
    folded = cli.planner_for(2)(cfg, 4)
    stage = cli.stage_config(cfg, 2)
    assert (stage.model.n_layers, stage.model.n_dense_layers) == (3, 0)
    alone = plan(stage, 2)
    a = alone.activation_detail
    assert folded.world == 2 and folded.params == alone.params
    assert folded.activations == 2 * (a.total - a.head) + a.head
