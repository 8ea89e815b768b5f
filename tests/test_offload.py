"""Activation offload (model.offload, layers/offload.py): the same numbers, the saved bytes moved.

Bit-exactness (torch.equal, CPU fp32) is claimed because the backward reads the same bytes at the
same geometry: offload is a byte copy out and back, no kernel changes (docs/numerics.md). The byte
counts are checked against the independent counter of saved storages (dropless.saved_bytes).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dropless.config import ModelConfig
from dropless.layers import offload
from dropless.model import MoEModel
from dropless.saved_bytes import AliveStorages, saved_bytes
from dropless.train.loop import Trainer
from dropless.fixed_fields import is_fixed
from test_recompute import B, S, ROUTERS, assert_equal, fwd_bwd, model_cfg, tokens
from tiny_run import rows, tiny

NAMES = [["layer"], ["attn"], ["attn_input"], ["norm"], ["moe"], ["experts"], ["attn", "norm", "moe"],
         ["attn_input", "norm", "experts"]]


def build(cfg: ModelConfig, off: list[str], recompute: list[str] = ()) -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(replace(cfg, offload=off, recompute=list(recompute)))


@pytest.mark.parametrize("router", ["softmax", "forced_balance"])
@pytest.mark.parametrize("names", NAMES, ids=lambda n: "+".join(n))
def test_offload_is_bit_identical(router: str, names: list[str]) -> None:
    cfg = model_cfg(*ROUTERS[router])
    ref = fwd_bwd(build(cfg, []))
    model = build(cfg, names)
    assert_equal(ref, fwd_bwd(model))
    count = model.offloader.counter
    assert count.bytes_to_host > 0 and count.bytes_to_device == count.bytes_to_host


def test_offload_beside_recompute_and_with_replay_is_bit_identical() -> None:
    """Disjoint scopes: attention and norms offloaded, the MoE layer recomputed with replayed ids."""
    cfg = model_cfg(*ROUTERS["bias_groups_sigmoid"])
    g = torch.Generator().manual_seed(2)
    replay = [torch.rand(B, S, 8, generator=g).argsort(-1)[..., :2] for _ in range(cfg.n_moe_layers)]
    ref = fwd_bwd(build(cfg, []), replay)
    assert_equal(ref, fwd_bwd(build(cfg, ["attn", "norm"], ["moe"]), replay))


def _blocks_saved_bytes(model: MoEModel, tok: torch.Tensor) -> int:
    """The storages autograd saves in each block, parameters and rotary tables excluded, by the
    saved_bytes counter (one block at a time, each on the previous one's output)."""
    x = model.embed(tok)
    cos, sin = model.rope_cos[:tok.shape[1]], model.rope_sin[:tok.shape[1]]
    total = 0
    for block in model.blocks:
        n = saved_bytes(lambda h: block(h, cos, sin).x, x, exclude=[*block.parameters(), cos, sin],
                        include_inputs=False)
        x, total = n.out, total + n.bytes
    return total


def test_offload_moves_every_saved_storage_once_and_no_parameter() -> None:
    """`layer` moves exactly the storages the blocks save (each once, however many views), and no
    parameter: a parameter copied to host would add its bytes."""
    cfg = model_cfg()
    tok = tokens()
    model = build(cfg, ["layer"])
    expected = _blocks_saved_bytes(build(cfg, []), tok)
    model(tok, tok).loss.backward()
    count = model.offloader.counter.take()
    assert count.bytes_to_host == expected and count.storages < count.tensors
    assert count.kept >= 2 * cfg.n_layers  # at least the qkv and output projection weights of each block
    assert model.offloader.counter == offload.OffloadCounter()  # take() reset it


def test_attn_input_moves_the_attention_input_only() -> None:
    """The qkv projection saves its input (moved) and its weight (a parameter: kept)."""
    cfg = model_cfg()
    model = build(cfg, ["attn_input"])
    tok = tokens()
    model(tok, tok).loss.backward()
    c = model.offloader.counter
    assert (c.tensors, c.storages, c.kept) == (cfg.n_layers, cfg.n_layers, cfg.n_layers)
    assert c.bytes_to_host == cfg.n_layers * B * S * cfg.d_model * 4


def test_one_storage_saved_twice_is_copied_once() -> None:
    off = offload.Offloader()
    x = torch.randn(5, 7, requires_grad=True, generator=torch.Generator().manual_seed(0))

    def f() -> torch.Tensor:
        h = x * 3  # a fresh storage, saved twice (mul saves both operands)
        return (h * h).sum() + (h.t() * 2).exp().sum()  # exp saves its output, a second storage

    f().backward()
    ref, x.grad = x.grad, None
    with off.scope():
        y = f()
    y.backward()
    c = off.counter
    assert (c.tensors, c.storages, c.bytes_to_host, c.bytes_to_device) == (3, 2, 2 * 5 * 7 * 4, 2 * 5 * 7 * 4)
    assert torch.equal(x.grad, ref)


def test_offload_releases_the_saved_originals(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the forward, the storages the blocks saved are gone from the forward's allocations:
    only the host copies hold their bytes (counted apart here)."""
    host: list[int] = []
    real = offload._HostCopy.__init__

    def recorded(self, t, stream):
        real(self, t, stream)
        host.append(self.host.data_ptr())

    monkeypatch.setattr(offload._HostCopy, "__init__", recorded)
    cfg = model_cfg("model.n_layers=4")
    tok = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def held(model: MoEModel) -> int:  # tests/test_recompute.py's held_bytes, less the host copies
        with AliveStorages() as alloc:
            out = model(tok, tok)
        n = alloc.alive_bytes(set(host))
        out.loss.backward()
        return n

    base, moved = held(build(cfg, [])), held(build(cfg, ["layer"]))
    logits = 2 * 4 * 32 * 256 * 4  # the logits and the CE's log-softmax, outside every block
    assert moved - logits < 0.25 * (base - logits), (base, moved)


def test_no_offload_without_autograd() -> None:
    model = build(model_cfg(), ["attn_input", "norm", "moe"])
    with torch.no_grad():
        model(tokens())
    assert model.offloader.counter == offload.OffloadCounter()


def test_offload_validation() -> None:
    for names, match in [(["attn_output"], "model.offload"), (["expert_fc1_input"], "experts"),
                         (["norm", "norm"], "overlap"),
                         (["moe", "experts"], "overlap"), (["layer", "attn"], "overlap"),
                         (["attn", "attn_input"], "overlap")]:
        with pytest.raises(ValueError, match=match):
            tiny(f"model.offload={names!r}".replace("'", '"'))
    with pytest.raises(ValueError, match="model.offload='layer': must be a list of names"):
        ModelConfig(offload="layer")
    for names, rc in [(["moe"], ["moe"]), (["experts"], ["moe"]), (["attn_input"], ["attn"]),
                      (["norm"], ["full"]), (["moe"], ["layer"]), (["layer"], ["norm"])]:
        with pytest.raises(ValueError, match="overlaps model.recompute"):
            tiny(f"model.offload={names!r}".replace("'", '"'), f"model.recompute={rc!r}".replace("'", '"'))
    tiny('model.offload=["attn","norm","experts"]', 'model.recompute=["shared_experts"]',
         "model.moe.n_shared_experts=1")  # disjoint scopes


def test_trainer_losses_identical_with_offload(tmp_path) -> None:
    """The trainer's bf16 autocast on this CPU (train.dtype auto), evaluation without hooks."""
    short = ["train.steps=3", "train.eval_every=3", "train.ckpt_every=3"]
    Trainer(tiny(*short), tmp_path / "plain").fit()
    Trainer(tiny(*short, 'model.offload=["attn","norm","moe"]'), tmp_path / "off").fit()
    plain = rows(tmp_path / "plain", "loss")
    assert len(plain) == 3 and plain == rows(tmp_path / "off", "loss")
    assert rows(tmp_path / "plain", "val_loss") == rows(tmp_path / "off", "val_loss")


def test_offload_may_change_on_resume() -> None:
    assert not is_fixed("model.offload")  # how the same network is computed, not what it is


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_is_bit_identical() -> None:
    """Pinned host copies on a side stream: the same gradients as without offload on the GPU."""
    cfg = model_cfg("train.device=cuda")
    tok = tokens().cuda()
    results = []
    for names in ([], ["layer"]):
        model = build(cfg, names).cuda()
        out = model(tok, tok)
        out.loss.backward()
        results.append([out.logits, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))
