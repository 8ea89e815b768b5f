"""LoRA runs (train.lora) in one process: recompute with the adapted experts, adapters-only checkpoints,
bit-exact resume, the base named by its seed, and the optimizers that may train adapters.

Bit-exactness (torch.equal) as in tests/test_recompute.py and tests/train/test_resume.py: the same
kernels on the same inputs at the same shapes, on the CPU in fp32. The distributed side (EP, FSDP2,
resume at another EP size) is tests/distributed/test_lora_ep.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dropless.config import LoRAConfig, load_config
from dropless.model import MoEModel
from dropless.runs import checkpoint as ckpt
from dropless.train.loop import Trainer
from tiny_run import check_crash_resume, tiny

LORA = ("train.lora.rank=4", 'train.lora.targets=["attn", "dense", "experts", "router"]')
SHORT = ("train.steps=4", "train.eval_every=4", "train.ckpt_every=2")
B, S = 2, 16


# -- recompute: the adapted experts recomputed, never re-routed ------------------------------------

def build(recompute: list[str]) -> MoEModel:
    """8 experts with an expert bias large enough to decide the top-k, a shared expert (adapted), every
    adapter target; B matrices set nonzero (they start at zero, where every A's gradient is zero and
    a wrong A gradient would pass unseen)."""
    cfg = tiny("model.moe.num_experts=8", "model.moe.n_shared_experts=1",
               "model.moe.router.use_expert_bias=true", "model.moe.router.score_func=sigmoid").model
    lora = LoRAConfig(rank=4, targets=["attn", "dense", "shared", "experts", "router"])
    torch.manual_seed(0)
    model = MoEModel(replace(cfg, recompute=recompute), lora=lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or "lora_b" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for i, layer in enumerate(model.moe_layers()):
            layer.router.set_bias(torch.randn(8, generator=torch.Generator().manual_seed(10 + i)))
    return model


def fwd_bwd(model: MoEModel, between=None) -> dict[str, torch.Tensor]:
    """Logits, losses, routing and every trainable gradient of one forward and backward; asserts that
    the frozen base got no gradient. `between(model)` runs after the forward, before the backward."""
    tok = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(2))
    out = model(tok, tok)
    if between is not None:
        between(model)
    out.loss.backward()
    res = {"logits": out.logits, "loss": out.loss, **{f"ids{i}": m.ids_TK for i, m in enumerate(out.moe)}}
    for n, p in model.named_parameters():
        if p.requires_grad:
            res[f"grad.{n}"] = p.grad
        else:
            assert p.grad is None, n
    return res


def reverse_bias(model: MoEModel) -> None:
    """Between forward and backward: the expert bias reversed, which changes every top-k choice a
    recompute that re-routed would make."""
    for layer in model.moe_layers():
        layer.router.set_bias(-10 * layer.router.expert_bias)


@pytest.mark.parametrize("modes", [["moe"], ["layer"], ["moe_act"]], ids=lambda m: m[0])
def test_lora_recompute_is_bit_identical_and_never_reroutes(modes: list[str]) -> None:
    ref = fwd_bwd(build([]))
    got = fwd_bwd(build(modes), between=reverse_bias)
    assert ref.keys() == got.keys()
    assert sum(k.startswith("grad.") and "experts.lora_" in k for k in ref) == 4
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    assert all(bool(ref[k].abs().sum() > 0) for k in ref if k.startswith("grad.")), "a zero gradient tests nothing"


# -- checkpoints and resume ------------------------------------------------------------------------

def test_lora_resume_is_bit_identical(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # killed at step 3, resumed from the step-2 checkpoint (adapters, router, optimizer state; the base
    # rebuilt from the seed): every loss and routing row as the uninterrupted run wrote it
    check_crash_resume(tmp_path, (*LORA, *SHORT), 3, 2, monkeypatch)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bf16"])
def test_lora_checkpoint_holds_adapters_only(tmp_path, optimizer: str) -> None:
    """The DCP metadata names the trainable parameters, the buffers and the optimizer state of the
    trainable parameters: no tensor of the frozen base under any key."""
    cfg = tiny(*LORA, *SHORT, "train.steps=2", "model.moe.router.use_expert_bias=true",
               f"train.optimizer={optimizer}")
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.fit()
    names = dict(trainer.model.named_parameters())
    trained = {n for n, p in names.items() if p.requires_grad}
    frozen = set(names) - trained
    buffers = {n for n, _ in trainer.model.named_buffers() if not n.startswith("rope_")}  # rope: not persistent
    assert buffers and frozen and len(trained) == 17  # attn 8, dense MLP 4, experts 4, the router
    params = {id(names[n]) for n in trained}  # the optimizer holds (and keeps state for) these alone
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == params
    assert {id(p) for p in trainer.optimizer.state} == params
    keys = dcp.FileSystemReader(str(ckpt.latest_checkpoint(tmp_path / "run"))).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    state_owners = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
    assert model_keys == trained | buffers
    assert state_owners == trained
    assert not any(k.endswith(tuple("." + n for n in frozen)) or any(f".{n}." in k for n in frozen) for k in keys)


def test_lora_resume_with_another_seed_base_is_refused(tmp_path) -> None:
    """train.lora.base_from="" is train.seed's initial weights: another seed is another base, and the
    adapters of one base on another are another model."""
    run = tmp_path / "run"
    Trainer(tiny(*LORA, *SHORT, "train.steps=2", "train.seed=3"), run).fit()
    with pytest.raises(ValueError, match=r"trained on base seed:3, but train.lora.base_from now gives seed:4"):
        Trainer(tiny(*LORA, *SHORT, "train.steps=4", "train.seed=4"), run, resume=True)


# -- optimizers ------------------------------------------------------------------------------------

def test_lora_refuses_muon() -> None:
    with pytest.raises(ValueError, match=r"train.optimizer='muon': with train.lora.rank=\d+: every matrix "
                                         r"Muon orthogonalises is frozen base"):
        load_config(None, [*LORA, "train.optimizer=muon"])
