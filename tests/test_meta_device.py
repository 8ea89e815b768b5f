"""Device-generic code, proved without a GPU: the MoE layer, the model with its optimizers and a
trainer step run with every tensor on the `meta` device.

A meta tensor has a shape and a dtype but no data, so on meta:
- a host read (`.item()`, `int()`, `bool()`, `.tolist()`) raises: the code that would wait for a GPU
  fails here;
- an op mixing a meta tensor with a CPU tensor of more than 0 dims raises;
- and `OnDevice` (below) flags every op whose output is not on meta: a tensor made without
  `device=` (a CPU tensor on a GPU run) or made on the CPU and copied over (`.to(device)` works on
  meta, so only the dispatch-level check sees it; on a GPU it is a host-to-device copy per step).
Two exceptions are allowed explicitly where they apply: torch's optimizers keep their step counter
as a 0-dim CPU tensor by design (AdamW, non-capturable), which never reads the device; and the
trainer draws each batch on the host from the host-resident corpus, then copies it over once (the
test checks that the batch arrives on the device).

torch's meta rule for `grouped_mm` copies the CUDA kernel's bf16-only check (the CPU kernel takes
fp32 too), so the layer runs with bf16 weights; the model and trainer keep fp32 master weights as in
training, and their grouped GEMMs go through bf16 casts (`bf16_grouped_mm`), as autocast would do
on a GPU (autocast itself does not exist on meta).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from dropless.config import MoEConfig, ModelConfig, RouterConfig, TrainConfig
from dropless.layers.moe import MoELayer
from dropless.model import MoEModel
from dropless.ops import grouped_gemm
from dropless.train.optim import build_optimizer
from tiny_run import tiny

META = torch.device("meta")


class OnDevice(TorchDispatchMode):
    """Raise at the first op whose output tensor is not on `device` (0-dim CPU tensors allowed with
    `allow_cpu_scalars`: optimizer step counters)."""

    def __init__(self, device: torch.device, allow_cpu_scalars: bool = False) -> None:
        super().__init__()
        self.device, self.allow_cpu_scalars = device, allow_cpu_scalars
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device != self.device:
                if self.allow_cpu_scalars and t.device.type == "cpu" and t.dim() == 0:
                    continue
                raise AssertionError(f"{func} made a tensor on {t.device}, not {self.device}")
        return out


def test_guard_catches_a_host_made_tensor() -> None:
    # The guard itself: a CPU draw copied to the device (what forced_balance did) and a tensor made
    # without device= are both caught; a host read fails on meta by itself.
    x = torch.zeros(4, device=META)
    with pytest.raises(AssertionError, match="aten.randperm"):
        with OnDevice(META):
            torch.randperm(4).to(META)
    with pytest.raises(AssertionError, match="cpu"):
        with OnDevice(META):
            x + torch.zeros(4)
    with pytest.raises(Exception):
        int(x.sum())


# Why each case: every routing strategy that runs without host reads, the router options that add
# ops (group-limited selection, expert bias, sigmoid scores, a slot cap), alignment padding (padded
# plans, masked plans with padding), shared experts, the capacity baseline (padded_bmm), and the
# statistics paths (detailed stats, sequence aux loss, quantile balancing).
LAYER_CASES = {
    "token_choice": dict(),
    "token_choice_group_limited_bias": dict(router=RouterConfig(
        score_func="sigmoid", n_groups=4, topk_groups=2, use_expert_bias=True)),
    "token_choice_align4_shared": dict(align=4, n_shared_experts=1, d_shared=16),
    "token_choice_quantile_seq_aux": dict(router=RouterConfig(use_expert_bias=True), balance=dict(
        quantile_balance=True, seq_aux_loss_coeff=0.01)),
    "expert_choice": dict(router=RouterConfig(strategy="expert_choice")),
    "expert_choice_align4": dict(align=4, router=RouterConfig(strategy="expert_choice")),
    "expert_threshold_cap": dict(router=RouterConfig(strategy="expert_threshold", max_experts_per_token=3)),
    "forced_balance": dict(router=RouterConfig(strategy="forced_balance")),
    "hash": dict(router=RouterConfig(strategy="hash")),
    "capacity_baseline": dict(capacity_factor=1.25),
    # identity experts: a masked plan built from token choice, the select and the identity stats
    "identity_experts": dict(n_identity_experts=2, router=RouterConfig(use_expert_bias=True)),
    # LatentMoE: the projections and the latent norm around dispatch (with identity experts inside)
    "latent_norm_identity": dict(latent_dim=16, latent_norm=True, n_identity_experts=1),
}


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_forward_backward_on_meta(case: str) -> None:
    kw = dict(LAYER_CASES[case])
    if isinstance(kw.get("balance"), dict):
        from dropless.config import BalanceConfig

        kw["balance"] = BalanceConfig(**kw["balance"])
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, d_expert=16, **kw))
    layer.to(device=META, dtype=torch.bfloat16)  # the router keeps computing in fp32
    layer.detailed_stats = True
    x = torch.randn(2, 12, 32, device=META, dtype=torch.bfloat16, requires_grad=True)
    token_ids = torch.randint(0, 256, (2, 12), device=META)
    guard = OnDevice(META)
    with guard:
        out = layer(x, token_ids=token_ids)
        loss = out.y.float().square().mean() + out.aux_loss + out.z_loss
        if out.seq_aux_loss is not None:
            loss = loss + out.seq_aux_loss
        loss.backward()
    assert out.y.device == META and out.y.shape == x.shape
    assert x.grad is not None and x.grad.device == META
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.device == META, name
    for name, s in vars(out.stats).items():
        assert s is None or s.device == META, name
    assert guard.ops > 50  # the backward ran under the guard too


def bf16_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the grouped GEMM through bf16 casts (module note: torch's meta rule wants bf16)."""
    real = grouped_gemm._grouped_mm

    def cast(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return real(a.bfloat16(), b.bfloat16(), offs=offs).to(a.dtype)

    monkeypatch.setattr(grouped_gemm, "_grouped_mm", cast)


def small_model_cfg(**moe) -> ModelConfig:
    return ModelConfig(d_model=32, n_layers=3, n_heads=2, max_seq_len=16, d_ff_dense=32,
                       moe=MoEConfig(num_experts=4, top_k=2, d_expert=16, **moe))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bf16"])
def test_model_step_with_the_trainers_optimizer_on_meta(optimizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bf16_grouped_mm(monkeypatch)
    model = MoEModel(small_model_cfg(router=RouterConfig(use_expert_bias=True))).to(META)
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer))
    tokens = torch.randint(0, 256, (2, 16), device=META)
    before = {n: p for n, p in model.named_parameters()}
    with OnDevice(META, allow_cpu_scalars=True):
        for _ in range(2):  # the second step runs on existing optimizer state
            out = model(tokens, tokens)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        assert p.device == META and p is before[name], name
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].device == META
    for name, b in model.named_buffers():
        assert b.device == META, name


# Trainer configurations: the default step; the router-buffer rules (loss-free bias, expert-threshold
# EMA) that run between steps; gradient accumulation with the global-batch aux loss (its no-grad
# counting pre-pass); quantile balancing with the sequence aux loss.
TRAINER_CASES = {
    "default": [],
    "bias_update_accum_global_aux": [
        "model.moe.router.use_expert_bias=true", "model.moe.balance.bias_update_rate=0.01",
        "train.grad_accum=2", "model.moe.balance.global_aux_loss_coeff=0.01"],
    "expert_threshold": ["model.moe.router.strategy=expert_threshold"],
    "quantile_seq_aux": ["model.moe.router.use_expert_bias=true", "model.moe.balance.quantile_balance=true",
                         "model.moe.balance.seq_aux_loss_coeff=0.01"],
    # the model knobs of docs/model_knobs.md: an explicit MoE layer list, identity experts
    "model_knobs": ["model.n_layers=3", "model.moe_layer_freq=[1]", "model.moe.n_identity_experts=2",
                    "model.moe.latent_dim=16", "model.moe.latent_norm=true", "model.block=parallel_moe",
                    "model.mtp_depth=1"],
}


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_trainer_step_on_meta(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Trainer.train_step between log steps: batches, autocast choice, forward, backward, the global
    # aux loss, clipping, the optimizer and the balancing rules, all on the trainer's device.
    from dropless.data.windows import Window, Windows
    from dropless.train.loop import Trainer

    bf16_grouped_mm(monkeypatch)
    real_draw = Windows.draw

    def host_drawn_batch(self: Windows, *args, **kwargs) -> Window:
        with _disable_current_modes():  # the host-side draw (module note); the result must be on meta
            w = real_draw(self, *args, **kwargs)
        assert w.x_BS.device == META and w.y_BS.device == META
        return w

    monkeypatch.setattr(Windows, "draw", host_drawn_batch)
    trainer = Trainer(tiny("train.dtype=auto", *TRAINER_CASES[case]), tmp_path, device=META)
    assert trainer.layout.placement.dtype == "fp32"  # no autocast exists on meta
    with OnDevice(META, allow_cpu_scalars=True):
        for step in range(2):
            sums, grad_norm = trainer.train_step(step, log_step=False)
    assert sums.loss.device == META and grad_norm.device == META
    assert all(p.device == META for p in trainer.model.parameters())
    assert all(b.device == META for b in trainer.model.buffers())


def test_evaluation_reads_the_host_once_on_meta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Evaluation sums on the device and reads the sums once at the end (a read per batch would wait
    # for the device batch by batch); that one read is counted here instead of raising.
    from dropless.data.windows import Windows
    from dropless.train.loop import Trainer

    bf16_grouped_mm(monkeypatch)
    trainer = Trainer(tiny(), tmp_path, device=META)
    real_evaluation = Windows.evaluation

    def host_drawn(self: Windows, *args, **kwargs):
        with _disable_current_modes():  # the host-side draw, as in the trainer test
            batches = list(real_evaluation(self, *args, **kwargs))
        assert all(w.x_BS.device == META for w in batches)
        return iter(batches)

    reads = []

    def tolist(t: torch.Tensor) -> list:
        reads.append(tuple(t.shape))
        return [1.0] * t.numel()

    monkeypatch.setattr(Windows, "evaluation", host_drawn)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with OnDevice(META):
        trainer.evaluate()
    assert reads == [(2,)]
