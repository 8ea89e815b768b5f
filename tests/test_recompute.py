"""Activation recompute (model.recompute, layers/recompute.py): the same numbers, fewer bytes kept.

Bit-exactness (torch.equal) is claimed because a recomputed region runs the same kernels on the same
inputs at the same shapes as the forward did (docs/numerics.md: same computation, same bits), on the
CPU in fp32. What could break it is routing: a recompute that re-decided the experts would compute a
different function; the re-route tests below fail if it does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dropless.config import ModelConfig, load_config
from dropless.model import MoEModel
from dropless.ops import routing
from dropless.saved_bytes import AliveStorages
from dropless.train.loop import Trainer
from tiny_run import TINY, crash_at, rows, tiny

B, S = 2, 16


def model_cfg(*extra: str) -> ModelConfig:
    # 8 experts so that group-limited routing (4 groups, best 2) has something to exclude; a shared
    # expert so that the MoE region holds it too
    return tiny("model.moe.num_experts=8", "model.moe.n_shared_experts=1", *extra).model


# Routing configurations whose weights must come out of the replay bit for bit: the expert bias
# enters selection only, the group mask and the renormalisation/scaling the weights' path.
ROUTERS = {
    "softmax": [],
    "bias_groups_sigmoid": ["model.moe.router.use_expert_bias=true", "model.moe.router.score_func=sigmoid",
                            "model.moe.router.n_groups=4", "model.moe.router.topk_groups=2",
                            "model.moe.router.scaling_factor=2.5"],
    "post_softmax": ["model.moe.router.pre_softmax=false", "model.moe.router.use_expert_bias=true"],
    "forced_balance": ["model.moe.router.strategy=forced_balance"],
    "hash": ["model.moe.router.strategy=hash"],
}
MODES = [["layer"], ["full"], ["moe"], ["attn"], ["norm"], ["shared_experts"], ["attn", "norm", "moe"],
         ["attn", "norm", "shared_experts"], ["attn", "norm", "moe_act"]]


def build(cfg: ModelConfig, recompute: list[str]) -> MoEModel:
    torch.manual_seed(0)
    model = MoEModel(replace(cfg, recompute=recompute))
    for i, layer in enumerate(model.moe_layers()):
        if layer.router.expert_bias is not None:  # large enough to change which experts win
            layer.router.set_bias(torch.randn(8, generator=torch.Generator().manual_seed(i)))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))


def fwd_bwd(model: MoEModel, replay: list[torch.Tensor] | None = None, between=None) -> dict:
    """Outputs, losses, routing and every parameter's gradient of one fwd+bwd; `between(model)` runs
    after the forward and before the backward."""
    tok = tokens()
    torch.manual_seed(5)  # forced_balance draws its ids from the default generator
    out = model(tok, tok, replay)
    if between is not None:
        between(model)
    out.loss.backward()
    res = {"logits": out.logits, "loss": out.loss, "ce": out.ce_loss, "moe_loss": out.moe_loss}
    for i, m in enumerate(out.moe):
        res.update({f"aux{i}": m.aux_loss, f"z{i}": m.z_loss, f"ids{i}": m.ids_TK,
                    f"counts{i}": m.stats.tokens_per_expert_E, f"probs{i}": m.probs_mean_E})
    res.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    return res


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("modes", MODES, ids=lambda m: "+".join(m))
def test_recompute_is_bit_identical(router: str, modes: list[str]) -> None:
    cfg = model_cfg(*ROUTERS[router])
    ref = fwd_bwd(build(cfg, []))
    assert_equal(ref, fwd_bwd(build(cfg, modes)))


@pytest.mark.parametrize("modes", [["layer"], ["moe"]], ids=lambda m: m[0])
def test_recompute_with_routing_replay_is_bit_identical(modes: list[str]) -> None:
    cfg = model_cfg(*ROUTERS["bias_groups_sigmoid"])
    g = torch.Generator().manual_seed(2)
    replay = [torch.rand(B, S, 8, generator=g).argsort(-1)[..., :2] for _ in range(cfg.n_moe_layers)]
    ref = fwd_bwd(build(cfg, []), replay)
    assert torch.equal(ref["ids0"].view(B, S, 2), replay[0])
    assert_equal(ref, fwd_bwd(build(cfg, modes), replay))


def test_detailed_stats_under_recompute() -> None:
    """The monitor's log-step statistics run inside the recomputed region too."""
    cfg = model_cfg()
    a, b = build(cfg, []), build(cfg, ["layer"])
    for m in (*a.moe_layers(), *b.moe_layers()):
        m.detailed_stats = True
    assert_equal(fwd_bwd(a), fwd_bwd(b))


@pytest.mark.parametrize("router", ["bias_groups_sigmoid", "forced_balance"])
@pytest.mark.parametrize("modes", [["layer"], ["moe"]], ids=lambda m: m[0])
def test_recompute_never_reroutes(router: str, modes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No routing decision in the backward: top-k and the forced draw are never called there, and a
    bias moved between forward and backward (which would change the top-k choice) changes nothing."""
    calls = {"n": 0}
    for name in ("topk_route", "forced_balance_ids"):
        real = getattr(routing, name)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(routing, name, counted)
    cfg = model_cfg(*ROUTERS[router])

    def move_router(model: MoEModel) -> None:
        assert calls["n"] == cfg.n_moe_layers  # one decision per MoE layer in the forward
        calls["n"] = 0
        for layer in model.moe_layers():
            if layer.router.expert_bias is not None:  # reverse the preferences
                layer.router.set_bias(-10 * layer.router.expert_bias)

    ref = fwd_bwd(build(cfg, []))
    model = build(cfg, modes)
    calls["n"] = 0
    assert_equal(ref, fwd_bwd(model, between=move_router))
    assert calls["n"] == 0


def held_bytes(model: MoEModel, tok: torch.Tensor) -> int:
    """Bytes of the storages the forward created that are still alive after it: what the graph keeps
    for the backward (saved tensors, and a checkpoint's inputs) plus the outputs; parameters and
    buffers were not created by the forward and do not count. (saved_tensors_hooks alone would miss
    what a checkpoint keeps: its own hooks shadow outer ones inside the region, and it holds its
    inputs by reference, not as saved tensors.)"""
    with AliveStorages() as alloc:
        out = model(tok, tok)
    held = alloc.alive_bytes()
    out.loss.backward()
    return held


def test_layer_recompute_keeps_fewer_bytes() -> None:
    cfg = model_cfg("model.n_layers=4")
    tok = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    base = held_bytes(build(cfg, []), tok)
    layer = held_bytes(build(cfg, ["layer"]), tok)
    moe = held_bytes(build(cfg, ["moe"]), tok)
    shared = held_bytes(build(cfg, ["shared_experts"]), tok)
    logits = 4 * 32 * 256 * 4
    assert layer < moe < shared < base
    # per block, `layer` keeps its input (B*S*D fp32) and the ids (B*S*K int64) and little else
    assert layer - 2 * logits < 0.25 * (base - 2 * logits), (base, moe, layer)


def test_no_checkpoint_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation and generation (no_grad) run the plain forward."""
    from dropless.layers import recompute

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint under no_grad")

    monkeypatch.setattr(recompute, "checkpoint", refuse)
    cfg = model_cfg()
    with torch.no_grad():
        assert torch.equal(build(cfg, [])(tokens()).logits, build(cfg, ["layer"])(tokens()).logits)


def test_trainer_losses_identical_with_layer_recompute(tmp_path: Path) -> None:
    short = ["train.steps=4", "train.eval_every=4", "train.ckpt_every=4"]
    Trainer(tiny(*short), tmp_path / "plain").fit()
    Trainer(tiny(*short, 'model.recompute=["layer"]'), tmp_path / "layer").fit()
    plain = rows(tmp_path / "plain", "loss")
    assert len(plain) == 4 and plain == rows(tmp_path / "layer", "loss")
    assert rows(tmp_path / "plain", "val_loss") == rows(tmp_path / "layer", "val_loss")


def test_resume_may_switch_recompute_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory knob, not the network: a run resumed with recompute continues bit for bit."""
    short = ["train.steps=4", "train.eval_every=4", "train.ckpt_every=2"]
    Trainer(tiny(*short), tmp_path / "full").fit()
    crash_at(Trainer(tiny(*short), tmp_path / "broken"), 3, monkeypatch)
    Trainer(tiny(*short, 'model.recompute=["layer"]'), tmp_path / "broken", resume=True).fit()
    assert rows(tmp_path / "full", "loss") == rows(tmp_path / "broken", "loss")


@pytest.mark.parametrize("value, words", [
    ('["attention"]', "must be one of"),
    ('["moe_act", "moe"]', "recomputes the expert activation already"),
    ('["layer", "moe_act"]', "recomputes the whole block"),
    ('["shared_experts", "moe"]', "recomputes the shared experts already"),
    ('["layer", "moe"]', "recomputes the whole block"),
    ('["full", "norm"]', "recomputes the whole block"),
    ('["moe", "moe"]', "twice"),
])
def test_recompute_names_validated(value: str, words: str) -> None:
    with pytest.raises(ValueError, match="model.recompute") as err:
        load_config(None, TINY + [f"model.recompute={value}"])
    assert words in str(err.value)


@pytest.mark.parametrize("extra", [
    ["model.moe.router.strategy=expert_choice"],
    ["model.moe.router.strategy=expert_threshold"],
    ["model.moe.router.norm_top_k=3"],
])
@pytest.mark.parametrize("modes", ['["layer"]', '["moe"]'])
def test_recompute_refuses_what_it_cannot_replay(extra: list[str], modes: str) -> None:
    with pytest.raises(ValueError, match="model.recompute"):
        load_config(None, TINY + [f"model.recompute={modes}"] + extra)


def test_shared_experts_recompute_needs_shared_experts() -> None:
    with pytest.raises(ValueError, match="n_shared_experts=0"):
        load_config(None, TINY + ['model.recompute=["shared_experts"]'])


def test_attn_and_norm_recompute_take_any_strategy() -> None:
    cfg = model_cfg("model.moe.router.strategy=expert_choice")
    assert_equal(fwd_bwd(build(cfg, [])), fwd_bwd(build(cfg, ["attn", "norm"])))
