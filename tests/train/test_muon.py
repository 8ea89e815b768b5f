"""Expert-wise Muon (train/muon.py): per-expert and per-block orthogonality, independence of experts and
of the gate/up halves, the batched path against its loop reference, which parameters go to AdamW, the
update formula, the on-device skip, and the trainer: loss falls, resume is bit-identical."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dropless.config import load_config
from dropless.model import MoEModel
from dropless.train.loop import Trainer
from dropless.train.muon import (
    NS_STEPS,
    Muon,
    Split,
    muon_param_groups,
    newton_schulz,
    orthogonalise,
    orthogonalise_many,
    orthogonalise_reference,
    scale_of,
)
from dropless.train.optim import build_optimizer, muon_ns_dtype, step_unless
from tiny_run import crash_at, rows, tiny

TINY_CE_FALL_ABOVE = 1.4  # as tests/train/test_training.py: the tiny run learns well past the unigram
from tolerances import NS_BF16_VS_FP32, NS_SINGULAR_BAND, assert_close

E, D, F = 4, 16, 8
GATE_UP = Split(batched=True, axis=-1, sizes=(F, F), out_axis=-1)  # [E, D, 2F], as GroupedExperts
DOWN = Split(batched=True, out_axis=-1)  # [E, F, D]
QKV = Split(sizes=(16, 8, 8))  # [Hq*Dh + 2*Hkv*Dh, D]: GQA, blocks of unequal height


def _grad(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _svals_in_band(o: torch.Tensor, scale: float, what: str) -> None:
    s = torch.linalg.svdvals(o.double() / scale)
    lo, hi = NS_SINGULAR_BAND
    assert float(s.min()) >= lo and float(s.max()) <= hi, f"{what}: singular values {s.min():.3f}..{s.max():.3f}"


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_expert_and_each_half_is_orthogonalised_on_its_own_scale(ns_dtype: torch.dtype) -> None:
    # experts whose gradients differ by 1e7 in size (a busy expert, a nearly idle one): each slice of the
    # update, and each of its gate and up halves, has singular values near 1, times the shape rule
    g_up = _grad((E, D, 2 * F), 0) * torch.tensor([1e3, 1.0, 1e-2, 1e-4]).view(E, 1, 1)
    o = orthogonalise(g_up, GATE_UP, rms_match=None, ns_dtype=ns_dtype)
    assert o.dtype == torch.float32
    for e in range(E):
        for half, cols in (("gate", slice(0, F)), ("up", slice(F, 2 * F))):
            _svals_in_band(o[e, :, cols], scale_of(D, F, -1, None), f"expert {e} {half}")
    g_down = _grad((E, F, D), 1) * torch.tensor([1.0, 1e-5, 1e2, 1.0]).view(E, 1, 1)
    o = orthogonalise(g_down, DOWN, rms_match=0.2, ns_dtype=ns_dtype)
    for e in range(E):
        _svals_in_band(o[e], scale_of(F, D, -1, 0.2), f"down expert {e}")
    assert scale_of(F, D, -1, 0.2) == 0.2 * math.sqrt(D)  # the RMS-matching rule: 0.2 sqrt(max(r, c))
    assert scale_of(D, F, -1, None) == 1.0 and scale_of(F, D, -1, None) == math.sqrt(D / F)  # fan-out/fan-in


def test_experts_and_halves_are_independent() -> None:
    # Each expert's (and each half's) update depends on its own gradient only. Orthogonalising the
    # flattened [E*D, 2F] tensor (or the whole [D, 2F]) would shrink expert 0's update when expert 1's
    # gradient grows, and mix the up half into the gate half.
    g = _grad((E, D, 2 * F), 2)
    base = orthogonalise(g, GATE_UP)
    other = g.clone()
    other[1] *= 1e3
    other[2] = 0  # an expert that got no tokens: no update
    other[3, :, F:] = _grad((D, F), 3)  # expert 3's up half only
    o = orthogonalise(other, GATE_UP)
    assert_close(o[0], base[0], msg="expert 0 moved with expert 1's gradient")
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    assert_close(o[3, :, :F], base[3, :, :F], msg="the gate half moved with the up half")
    # a rank whose FSDP2 shard of the experts is empty (fewer local experts than edp ranks)
    assert orthogonalise(torch.zeros(0, D, 2 * F), GATE_UP).shape == (0, D, 2 * F)
    # a single-token expert: a rank-1 gradient 1e-6 the size of the others still gets a unit-size step
    lone = g.clone()
    lone[0] = 1e-6 * torch.outer(_grad((D,), 4), _grad((2 * F,), 5))
    s = torch.linalg.svdvals(orthogonalise(lone, GATE_UP, rms_match=None)[0, :, :F])
    assert NS_SINGULAR_BAND[0] <= float(s[0]) <= NS_SINGULAR_BAND[1] and float(s[1]) < 1e-3


@pytest.mark.parametrize("split,shape", [(GATE_UP, (E, D, 2 * F)), (DOWN, (E, F, D)), (QKV, (32, D)),
                                         (Split(), (D, 3)), (Split(batched=True), (1, 5, 7))],
                         ids=["gate_up", "down", "qkv_gqa", "tall_2d", "one_expert_odd"])
def test_batched_path_matches_the_loop_reference(split: Split, shape: tuple[int, ...]) -> None:
    g = _grad(shape, 6)
    assert_close(orthogonalise(g, split), orthogonalise_reference(g, split))


def test_bf16_iteration_is_the_fp32_one_rounded() -> None:
    # the bf16 iteration (train.muon_ns_dtype) computes the same polar factor as the fp32 one, up to
    # bf16's rounding; a wrong cast (an un-normalised bf16 input, a dropped step) lands far outside it
    g = _grad((E, 2 * D, D), 8)
    diff = (newton_schulz(g, dtype=torch.bfloat16) - newton_schulz(g)).abs().max()
    assert float(diff) <= NS_BF16_VS_FP32, f"bf16 vs fp32 iteration: max diff {float(diff):.4f}"
    assert not torch.equal(newton_schulz(g, dtype=torch.bfloat16), newton_schulz(g))  # it did run in bf16


def test_muon_ns_dtype_config_and_auto() -> None:
    assert muon_ns_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert muon_ns_dtype("auto", None) == torch.float32  # an fp32 run (no autocast): no fast bf16 GEMM
    assert muon_ns_dtype("fp32", torch.bfloat16) == torch.float32
    assert muon_ns_dtype("bf16", None) == torch.bfloat16
    with pytest.raises(ValueError, match="train.muon_ns_dtype"):
        load_config(None, ["train.muon_ns_dtype=fp16"])
    cfg = load_config(None, ["train.optimizer=muon", "train.muon_ns_dtype=auto"])
    assert build_optimizer(_model(), cfg.train, torch.bfloat16).ns_dtype == torch.bfloat16
    assert build_optimizer(_model(), cfg.train, None).ns_dtype == torch.float32
    # the default is auto (docs/optimizers.md: bf16 measured no worse on three seeds): a bf16 run
    # iterates in bf16, an fp32 run in fp32
    default = load_config(None, ["train.optimizer=muon"]).train
    assert build_optimizer(_model(), default, torch.bfloat16).ns_dtype == torch.bfloat16
    assert build_optimizer(_model(), default, None).ns_dtype == torch.float32


def test_newton_schulz_is_the_quintic_iteration() -> None:
    # the iteration written out for one wide matrix: X0 = G / ||G||_F, X <- aX + (bA + cA^2)X, A = X X^T
    g = _grad((6, 9), 7).double()
    x = g / (g.norm() + 1e-7)
    for _ in range(NS_STEPS):
        a_ = x @ x.T
        x = 3.4445 * x + (-4.7750 * a_ + 2.0315 * a_ @ a_) @ x
    assert_close(newton_schulz(g.float()[None])[0], x.float())
    assert_close(newton_schulz(g.float().T[None])[0], x.float().T)  # a tall matrix: the transpose's


def _model(*extra: str) -> MoEModel:
    return MoEModel(load_config(None, ["model.d_model=32", "model.n_layers=3", "model.n_heads=4",
                                       "model.n_kv_heads=2", "model.d_ff_dense=64", "model.moe.num_experts=4",
                                       "model.moe.top_k=2", "model.moe.d_expert=16", *extra]).model)


def test_parameter_groups() -> None:
    model = _model("model.moe.n_shared_experts=1", "model.moe.d_shared=16", "model.tie_embeddings=false",
                   "model.attn_bias=true", "model.moe.router.use_expert_bias=true")
    groups, splits = muon_param_groups(model, weight_decay=0.1)
    name = {id(p): n for n, p in model.named_parameters()}
    muon = {name[id(p)] for g in groups if g["muon"] for p in g["params"]}
    adamw = {name[id(p)]: g["weight_decay"] for g in groups if not g["muon"] for p in g["params"]}
    every = {n for n, _ in model.named_parameters()}
    assert muon | set(adamw) == every and not muon & set(adamw)
    assert {n.split(".", 2)[-1] for n in muon} == {
        "attn.qkv.weight", "attn.out.weight", "ffn.gate_up.weight", "ffn.down.weight",  # dense MLP
        "ffn.experts.w_gate_up_EDF", "ffn.experts.w_down_EFD",
        "ffn.shared.gate_up.weight", "ffn.shared.down.weight"}
    # embeddings, the untied head and routers decay on AdamW; norms and biases do not
    assert {n for n, wd in adamw.items() if wd} == {"embed.weight", "head.weight", "blocks.1.ffn.router.weight",
                                                    "blocks.2.ffn.router.weight"}
    assert all(n.endswith(("norm.weight", ".bias")) for n, wd in adamw.items() if not wd)
    assert all(p.dim() >= 2 for g in groups if g["muon"] for p in g["params"])
    # the expert bias is a buffer: in no group
    assert "blocks.1.ffn.router.expert_bias" in dict(model.named_buffers())
    qkv = splits[model.blocks[0].attn.qkv.weight]
    assert qkv.sizes == (32, 16, 16)  # q: 4 heads x 8, k and v: 2 heads x 8
    gu = splits[model.blocks[1].ffn.experts.w_gate_up_EDF]
    assert gu.batched and gu.axis == -1 and gu.sizes == (16, 16)
    tied = muon_param_groups(_model(), 0.1)[0]
    assert sum(p is _model().embed.weight for g in tied for p in g["params"]) == 0  # not double-listed
    assert sum(len(g["params"]) for g in tied) == len(list(_model().parameters()))


def _loss(model: MoEModel, seed: int) -> torch.Tensor:
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model(x, x).loss


def test_one_step_follows_the_formula() -> None:
    # momentum m = (1 - mu) g from zero, Nesterov u = (1 - mu) g + mu m, p <- p (1 - lr wd) - lr O(u);
    # the AdamW half: torch's AdamW (single-tensor implementation, the same formula)
    torch.manual_seed(0)
    model = _model()
    ref = _model()
    ref.load_state_dict(model.state_dict())
    cfg = load_config(None, ["train.optimizer=muon", "train.lr=0.01", "train.weight_decay=0.1"]).train
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, Muon)
    _loss(model, 0).backward()
    _loss(ref, 0).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    groups, splits = muon_param_groups(ref, 0.1)
    adam = torch.optim.AdamW([g for g in groups if not g["muon"]], lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                             foreach=False)
    adam.step()
    refs = dict(ref.named_parameters())
    mu = 0.95
    for n, p in model.named_parameters():
        q = refs[n]
        if q in splits:
            g = q.grad
            u = (1 - mu) * g + mu * ((1 - mu) * g)
            want = before[n] * (1 - 0.01 * 0.1) - 0.01 * orthogonalise(u, splits[q])
            assert_close(p.detach(), want, msg=n)
        else:
            assert_close(p.detach(), q.detach(), msg=n)


def test_skip_leaves_everything_bit_identical() -> None:
    torch.manual_seed(0)
    model = _model()
    cfg = load_config(None, ["train.optimizer=muon"]).train
    opt = build_optimizer(model, cfg)
    for step in range(2):
        _loss(model, step).backward()
        step_unless(opt, torch.tensor(False))
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    _loss(model, 5).backward()
    step_unless(opt, torch.tensor(True))
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    for p, s in opt.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    assert all(float(s["step"]) == 2 for s in opt.state.values() if "step" in s)


def test_muon_trains_and_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = tmp_path / "full"
    trainer = Trainer(tiny("train.optimizer=muon"), full)
    trainer.fit()
    assert isinstance(trainer.optimizer, Muon)
    train = rows(full, "loss")
    assert train[-1]["ce_loss"] < train[0]["ce_loss"] - TINY_CE_FALL_ABOVE  # measured 5.55 -> 3.62
    broken = tmp_path / "broken"
    crash_at(Trainer(tiny("train.optimizer=muon"), broken), 14, monkeypatch)
    Trainer(tiny("train.optimizer=muon"), broken, resume=True).fit()
    assert rows(full, "loss") == rows(broken, "loss")  # bit-identical floats after the step-10 resume
    assert rows(full, "val_loss") == rows(broken, "val_loss")


def test_config_accepts_muon_with_buffered_ep() -> None:
    # the buffered overflow guard needs a device-side skip and eagerly created state: Muon has both
    cfg = load_config(None, ["train.optimizer=muon", "parallel.ep_mode=buffered", "parallel.ep_size=2"])
    assert cfg.train.optimizer == "muon"
    with pytest.raises(ValueError, match="parallel.ep_mode"):
        load_config(None, ["train.optimizer=adamw_bf16", "parallel.ep_mode=buffered", "parallel.ep_size=2"])
    with pytest.raises(ValueError, match="rms_match"):
        Muon([{"params": [torch.zeros(2, 2)], "muon": False}], {}, rms_match=0.0)
    m = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="no Split"):
        Muon([{"params": [m], "muon": True}], {})


MIXED = [((16, 64, 96), Split(batched=True, axis=-1, sizes=(48, 48), out_axis=-1)),  # gate|up
         ((16, 48, 64), Split(batched=True, out_axis=-1)),  # down
         ((5, 48, 20), Split(batched=True, out_axis=-1)),  # tall experts
         ((192, 64), Split(sizes=(64, 64, 64))),  # q|k|v
         ((256, 64), Split(sizes=(128, 128))),  # gate|up rows, tall halves
         ((64, 128), Split()),
         ((128, 64), Split()),  # tall: alone, a transposed view; beside the halves above, stacked
         ((0, 32, 64), Split(batched=True, axis=-1, sizes=(32, 32), out_axis=-1))]  # no local experts


@pytest.mark.parametrize("chunk", [1, 3 * 4 * 64 * 64, None], ids=["one_by_one", "about_threes", "all"])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batching_same_shapes_changes_no_bits(chunk: int | None, ns_dtype: torch.dtype) -> None:
    """Blocks of several weights grouped by shape and iterated in chunks (`chunk` bytes of matrices
    per call; 1: one matrix at a time) give each weight's own orthogonalisation, whatever the chunk
    (muon_ns.py: the CPU takes ~1 MiB at a time, CUDA all of a shape). Bit for bit in bf16 (oneDNN:
    checked under its AMX, AVX-512 and AVX2 paths); in fp32 MKL's batched GEMM on its AVX2 path rounds
    a matrix's last bits differently by batch size on some CPUs (measured on an AMX Xeon under
    MKL_ENABLE_INSTRUCTIONS=AVX2: 1.3e-6 at most, entries ~0.1), so fp32 is held to REFERENCE."""
    g = torch.Generator().manual_seed(0)
    us = [torch.randn(shape, generator=g) for shape, _ in MIXED]
    splits = [s for _, s in MIXED]
    many = orthogonalise_many(us, splits, ns_dtype=ns_dtype, chunk_bytes=chunk)
    for u, s, o in zip(us, splits, many):
        alone = orthogonalise(u, s, ns_dtype=ns_dtype)
        if ns_dtype == torch.bfloat16:
            assert torch.equal(o, alone), (tuple(u.shape), s)
        else:
            assert_close(o, alone, msg=f"{tuple(u.shape)} {s}")


def test_a_bucket_of_parameters_steps_as_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA rule (every Muon parameter in one bucket, all same-shape matrices in one iteration)
    leaves the weights and momenta bit-identical to the CPU's parameter-by-parameter step."""
    from dropless.train import muon as muon_mod

    def run(bucket: bool) -> tuple[dict, dict]:
        torch.manual_seed(0)
        model = _model()
        # the bf16 iteration: batching is bit-exact there on every oneDNN path (fp32 is not on MKL's
        # AVX2 path: test_batching_same_shapes_changes_no_bits)
        opt = build_optimizer(model, load_config(None, ["train.optimizer=muon", "train.weight_decay=0.1",
                                                        "train.muon_ns_dtype=bf16"]).train)
        if bucket:
            monkeypatch.setattr(muon_mod, "bucket_bytes", lambda device: 2**40)
            monkeypatch.setattr(muon_mod, "ns_chunk_bytes", lambda device: None)
        for step in range(2):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        monkeypatch.undo()
        return ({n: p.detach().clone() for n, p in model.named_parameters()},
                {i: s["momentum_buffer"] for i, s in enumerate(opt.state.values()) if "momentum_buffer" in s})

    (w1, m1), (w2, m2) = run(False), run(True)
    assert all(torch.equal(w1[n], w2[n]) for n in w1)
    assert m1.keys() == m2.keys() and all(torch.equal(m1[i], m2[i]) for i in m1)
