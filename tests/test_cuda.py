"""The layer, the model and the trainer on a CUDA device: skipped without one (scripts/gpu_check.sh
runs them on a GPU machine).

What only a GPU shows:
- no host sync inside the layer: forward and backward under `torch.cuda.set_sync_debug_mode("error")`,
  for every case of the meta-device test (strategies, router options, padding, statistics);
- the same results as on the CPU: the layer in bf16 on both, with the expert choices replayed from
  the CPU router (fp32 logits from different GEMM kernels could flip a near tie, which is not a bug),
  outputs and gradients within the two-device bf16 tolerance (tolerances.CUDA_VS_CPU_BF16);
- the trainer on `train.device=cuda`: every parameter and buffer on the GPU, bf16 picked by auto, the
  loss falls, and a rerun is bit-identical (deterministic algorithms on).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.config import BalanceConfig, MoEConfig, RouterConfig
from dropless.layers.moe import MoELayer
from test_meta_device import LAYER_CASES
from tiny_run import tiny
from tolerances import CUDA_VS_CPU_BF16, assert_close

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _layer(kw: dict, d: int = 64) -> MoELayer:
    kw = dict(kw)
    if isinstance(kw.get("balance"), dict):
        kw["balance"] = BalanceConfig(**kw["balance"])
    torch.manual_seed(0)
    return MoELayer(d, MoEConfig(num_experts=8, top_k=2, d_expert=32, **kw))


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_has_no_host_sync_on_cuda(case: str) -> None:
    layer = _layer(LAYER_CASES[case]).cuda().to(torch.bfloat16)
    layer.router.float()
    layer.detailed_stats = True
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    token_ids = torch.randint(0, 256, (4, 64), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x, token_ids=token_ids)
        loss = out.y.float().square().mean() + out.aux_loss + out.z_loss
        if out.seq_aux_loss is not None:
            loss = loss + out.seq_aux_loss
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all()


TOKEN_CHOICE = {
    "plain": dict(),
    "align8_shared": dict(align=8, n_shared_experts=1, d_shared=32),
    "sigmoid_groups": dict(router=RouterConfig(score_func="sigmoid", n_groups=4, topk_groups=2)),
}


@pytest.mark.parametrize("case", sorted(TOKEN_CHOICE))
def test_layer_on_cuda_matches_cpu(case: str) -> None:
    ref = _layer(TOKEN_CHOICE[case])
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    ids = ref.router(x).ids_TK  # one routing for both devices
    results = []
    for dev in ("cpu", "cuda"):
        layer = _layer(TOKEN_CHOICE[case]).to(device=dev, dtype=torch.bfloat16)
        layer.router.float()  # before loading: the router keeps its exact fp32 weights
        layer.load_state_dict(ref.state_dict())
        xx = x.to(device=dev, dtype=torch.bfloat16).requires_grad_(True)
        y = layer(xx, replay_ids=ids.to(dev)).y
        y.float().square().mean().backward()
        got = {"y": y.detach(), "grad x": xx.grad}
        got.update({n: p.grad for n, p in layer.named_parameters()})
        results.append({n: t.float().cpu() for n, t in got.items()})
    cpu, cuda = results
    for name in cpu:  # printed for the tolerance's reason (pytest -s)
        worst = float((cuda[name] - cpu[name]).abs().max() / cpu[name].abs().max().clamp_min(1e-30))
        print(f"{case} {name}: max |cuda - cpu| / max |cpu| = {worst:.2e}")
    for name in cpu:
        assert_close(cuda[name], cpu[name], CUDA_VS_CPU_BF16, msg=name)


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_trainer_on_cuda(tmp_path: Path) -> None:
    from dropless.train.loop import Trainer

    trainer = Trainer(tiny("train.device=cuda"), tmp_path / "a")
    assert trainer.layout.device.type == "cuda" and trainer.layout.placement.dtype == "bf16"
    assert all(p.is_cuda for p in trainer.model.parameters())
    assert all(b.is_cuda for b in trainer.model.buffers())
    summary = trainer.fit()
    assert summary["device"].startswith("cuda") and summary["dtype"] == "bf16"
    losses = _losses(tmp_path / "a")
    assert losses[-1] < losses[0] - 0.7
    assert all(s["exp_avg"].is_cuda for s in trainer.optimizer.state.values())
    Trainer(tiny("train.device=cuda"), tmp_path / "b").fit()
    assert _losses(tmp_path / "b") == losses  # deterministic algorithms: a rerun is bit-identical


def test_kv_cache_generation_on_cuda() -> None:
    """Greedy KV-cache decode on the GPU (fp32) gives the tokens of the recompute path for a
    left-padded batch, and the decode path (layers/decode_experts.py, auto below its CUDA threshold)
    agrees with the grouped path there; bf16 generation runs."""
    from dropless.model import MoEModel
    from dropless.serve.generate import generate

    torch.manual_seed(0)
    model = MoEModel(tiny().model).cuda().eval()
    prompts = [list(b"def main("), list(b"x"), list(b"import os\n")]
    cached = generate(model, prompts, 20, temperature=0).tokens
    assert cached == generate(model, prompts, 20, temperature=0, use_cache=False).tokens
    for layer in model.moe_layers():
        layer.decode_max_tokens = 0  # the grouped path for every step
    assert generate(model, prompts, 20, temperature=0).tokens == cached
    assert len(generate(model, prompts, 8, temperature=0, dtype="bf16").tokens[0]) == 8
