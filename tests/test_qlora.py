"""train.lora.base: the frozen base held in bf16 or packed (fp8, mxfp4, nvfp4), layers/frozen_base.py.

What a packed base must compute is fixed independently of the packing code: the fp32 LoRA model
whose frozen matrices were replaced by their bf16 values and whose routed experts were replaced by
`ops.quant.fake_quantize` of those (per expert, along the reduction dim). The two run the same
products on the same numbers (the lean Functions get the weights from `dequant` instead of as
arguments), so logits and every adapter's gradient are compared bit for bit, in fp32 and under
bf16 autocast. And: fp32 changes nothing, the dequantised stacks are never kept for the backward,
only the adapters get gradients, a few steps on an mxfp4 base lower the loss, the stored bytes are
the formats' (mxfp4 4.25 bits per weight), and what cannot work is refused naming the field.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropless.config import load_config
from dropless.layers import frozen_base, lora
from dropless.layers.experts import GroupedExperts
from dropless.layers.packed_experts import pack_weight
from dropless.model import MoEModel
from dropless.ops import frozen_linear
from dropless.ops.quant import fake_quantize, quantize
from dropless.runs.presets import preset_path
from tests.tolerances import REFERENCE, assert_close

# 3 blocks (one dense, two MoE with a shared expert), widths that the 32-blocks and 16-blocks divide
SIZES = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.moe.num_experts=4",
         "model.moe.d_expert=32", "model.d_ff_dense=64", "model.moe.n_shared_experts=1",
         "model.max_seq_len=16", "train.seq_len=16", "train.batch_size=2", "train.optimizer=adamw"]
ALL = '["attn","experts","shared","dense","router"]'
BASES = ["bf16", "fp8", "mxfp4", "nvfp4"]


def cfg_of(base: str, targets: str = ALL, *extra: str):
    return load_config(preset_path("tiny"), [*SIZES, "train.lora.rank=4", f"train.lora.targets={targets}",
                                             f"train.lora.base={base}", *extra])


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def build(base: str, targets: str = ALL) -> MoEModel:
    """The adapted model with B nonzero (so the adapters change the output), not yet packed."""
    cfg = cfg_of(base, targets)
    model = MoEModel(cfg.model, seed=0, lora=cfg.train.lora)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora.is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def fake_quantised(w_EXY: torch.Tensor, base: str) -> torch.Tensor:
    """The values a packed base must compute with: ops.quant's, per expert, along X."""
    w = w_EXY.float()
    if base == "bf16":
        return w
    if base == "nvfp4":  # one tensor scale per expert matrix
        return torch.stack([fake_quantize(w_XY, "nvfp4", dim=0) for w_XY in w])
    return fake_quantize(w, frozen_base.PACKED[base], dim=1)


def reference(held: dict[str, torch.Tensor], base: str, targets: str) -> MoEModel:
    """The fp32-base model holding `held`'s values, the expert stacks fake-quantised."""
    cfg = cfg_of("fp32", targets)
    ref = MoEModel(cfg.model, seed=1, lora=cfg.train.lora)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            v = held[name].float()
            p.copy_(fake_quantised(v, base) if name.endswith(frozen_base.STACKS) else v)
    return ref


def step(model: MoEModel, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(tokens(), tokens(1))
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_fp32_base_is_the_model_as_before() -> None:
    """base fp32 holds and runs the base as loaded: every parameter fp32, no class swapped, no reader
    set, `pack_frozen_base` a no-op, and with B = 0 the logits are the unadapted model's, bit for bit."""
    cfg = cfg_of("fp32")
    model = MoEModel(cfg.model, seed=0, lora=cfg.train.lora)
    before = {n: p for n, p in model.named_parameters()}
    frozen_base.pack_frozen_base(model, "fp32")
    assert {n: p for n, p in model.named_parameters()} == before  # the same tensors
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(type(m) is frozen_base.BaseLinear for m in model.modules())
    assert all(m.dequant_base is None for m in model.modules() if isinstance(m, GroupedExperts))
    plain = MoEModel(cfg.model, seed=0)
    assert torch.equal(model(tokens()).logits, plain(tokens()).logits)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("targets", [ALL, '["attn"]'], ids=["all_targets", "attn_only"])
@pytest.mark.parametrize("base", BASES)
def test_base_computes_the_fake_quantised_model(base: str, targets: str, autocast: bool) -> None:
    """Logits and every trainable gradient equal the reference model's (module note), bit for bit.
    attn_only: the experts have no adapters and run the lean experts with `dequant`."""
    model = build(base, targets)
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert held["blocks.1.ffn.experts.w_gate_up_EDF"].dtype == torch.bfloat16
    frozen_base.pack_frozen_base(model, base)
    logits, grads = step(model, autocast)
    ref_logits, ref_grads = step(reference(held, base, targets), autocast)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and grads
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


@pytest.mark.parametrize("base", ["bf16", "mxfp4"])
def test_decode_sized_calls_read_the_base_too(base: str) -> None:
    """Without autograd and with a batch's worth of tokens the MoE layers take the decode path
    (layers/decode_experts.py), which reads the expert stacks in place; with a base held narrow they
    stay on the grouped path: the reference's logits (whose experts take the decode path, the same
    products in another order: REFERENCE)."""
    model = build(base, '["attn"]')
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen_base.pack_frozen_base(model, base)
    ref = reference(held, base, '["attn"]')
    with torch.no_grad():
        x = tokens()[:, :1]
        assert_close(model(x).logits, ref(x).logits, REFERENCE[torch.float32])


@pytest.mark.parametrize("base", BASES)
def test_only_the_trainable_parameters_get_gradients(base: str) -> None:
    """The adapters (and the targeted routers) get nonzero gradients; no frozen parameter or packed
    buffer has one; the packed stacks are gone from the parameters."""
    model = build(base)
    frozen_base.pack_frozen_base(model, base)
    _, grads = step(model, False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == trainable
    assert all(lora.is_adapter(n) or n.endswith("router.weight") for n in trainable)
    assert all(g.abs().sum() > 0 for g in grads.values())
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(frozen_base.STACKS) for n in names) == (base != "bf16")
    assert all(not b.requires_grad for b in model.buffers())


@pytest.mark.parametrize("targets", [ALL, '["attn"]'], ids=["lora_experts", "lean_experts"])
def test_dequantised_stacks_are_not_kept_for_the_backward(targets: str) -> None:
    """No tensor of an expert stack's shape is saved for the backward, and each MoE layer
    dequantises exactly twice per step (forward, backward). The plain composition (`lean = False`)
    keeps them: the check sees them there."""
    model = build("mxfp4", targets)
    frozen_base.pack_frozen_base(model, "mxfp4")
    layers = model.moe_layers()
    stacks = {(4, 64, 64), (4, 32, 64)}  # E=4: gate|up [D=64, W=64], down [F=32, D=64]
    calls = []
    real = frozen_base.BaseReader.weights

    def counted(self, dtype):
        calls.append(self)
        return real(self, dtype)

    def saved_shapes(lean: bool) -> set[tuple[int, ...]]:
        shapes: set[tuple[int, ...]] = set()
        for layer in layers:
            layer.experts.lean = lean
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.add(tuple(t.shape)) or t, lambda t: t):
            loss = model(tokens(), tokens(1)).loss
        loss.backward()
        return shapes

    frozen_base.BaseReader.weights = counted
    try:
        assert not saved_shapes(True) & stacks
        assert len(calls) == 2 * len(layers)
        assert saved_shapes(False) & stacks
    finally:
        frozen_base.BaseReader.weights = real


def test_training_on_an_mxfp4_base_lowers_the_loss() -> None:
    """Twenty AdamW steps on one batch: the adapters alone bring the loss down (5.60 to 5.06 when
    written), and the packed base is the same bytes after them."""
    model = build("mxfp4")
    frozen_base.pack_frozen_base(model, "mxfp4")
    packed = {n: b.clone() for n, b in model.named_buffers() if "_codes" in n or "_scales" in n}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(20):
        loss = model(tokens(), tokens(1)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.25, losses
    assert all(torch.equal(b, packed[n]) for n, b in model.named_buffers() if n in packed) and packed


@pytest.mark.parametrize("base,bits", [("bf16", 16.0), ("fp8", 8.25), ("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_stored_bytes_per_format(base: str, bits: float) -> None:
    """The experts' stored bytes: the buffers the model holds, `stored_bytes`'s formula, and bits per
    weight (nvfp4: plus one fp32 tensor scale per expert matrix); the other frozen matrices bf16."""
    model = build(base)
    frozen_base.pack_frozen_base(model, base)
    got = frozen_base.frozen_base_bytes(model)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    held = sum(b.numel() * b.element_size() for m in experts for b in m.buffers())
    held += sum(p.numel() * p.element_size() for m in experts for n, p in m.named_parameters()
                if n in frozen_base.STACKS)
    weights = sum(4 * (64 * 64 + 32 * 64) for _ in experts)  # E=4: gate|up [64, 64], down [32, 64]
    formula = sum(frozen_base.stored_bytes(base, 4, X, Y) for _ in experts for X, Y in ((64, 64), (32, 64)))
    assert got["experts"] == held == formula
    tensor_scales = 4 * 2 * 4 * len(experts) if base == "nvfp4" else 0
    assert 8 * (got["experts"] - tensor_scales) / weights == bits
    frozen_other = [p for n, p in model.named_parameters() if not p.requires_grad and "experts" not in n]
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and m is not model.head}
    assert all((p.dtype == torch.bfloat16) == (id(p) in linear) for p in frozen_other)
    assert got["other"] == sum(p.numel() * p.element_size() for p in {id(p): p for p in frozen_other}.values())


@pytest.mark.parametrize("base", ["fp8", "mxfp4", "nvfp4"])
def test_chunked_packing_is_the_whole_stacks_bytes(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing and dequantising a few experts at a time (CHUNK_BYTES shrunk to one expert and a
    half) gives the bytes of quantising the whole stack (packed_experts' for the 4-bit formats) and
    back `fake_quantize`'s values, in the dtype asked for (one rounding of the fp32 values)."""
    w = torch.randn(5, 64, 48, generator=torch.Generator().manual_seed(0)) * 0.1
    w[2, :32] = 0.0  # an all-zero block: the smallest scale, exact zeros back
    monkeypatch.setattr(frozen_base, "CHUNK_BYTES", 6 * 64 * 48)
    codes, scales, ts = frozen_base.pack_stack(w, base)
    if base == "fp8":
        q = quantize(w, "mxfp8_e4m3", dim=1)
        whole = (q.data.view(torch.uint8), q.scale.view(torch.uint8), None)
    else:
        whole = pack_weight(w, base)
    assert torch.equal(codes, whole[0]) and torch.equal(scales, whole[1])
    assert (ts is None and whole[2] is None) or torch.equal(ts, whole[2])
    for dtype in (torch.float32, torch.bfloat16):
        back = frozen_base.unpack_stack(codes, scales, ts, base, dtype)
        assert back.dtype == dtype and torch.equal(back, fake_quantised(w, base).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_frozen_linear_matches_its_reference(dtype: torch.dtype) -> None:
    """The bf16 weight computed in x's dtype: output and input gradient the plain composition's bit
    for bit (the forward is that call, the backward the matmul autograd runs for it), the stored
    weight kept for the backward (not its cast copy)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(24, generator=g)
    x0 = torch.randn(3, 5, 40, generator=g, dtype=dtype)
    dy = torch.randn(3, 5, 24, generator=g, dtype=dtype)
    out = {}
    for fn in (frozen_linear.frozen_linear, frozen_linear.frozen_linear_reference):
        x = x0.clone().requires_grad_(True)
        kept: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            y = fn(x, w, b)
        (y * dy).sum().backward()
        out[fn.__name__] = (y.detach(), x.grad, kept)
    y, dx, kept = out["frozen_linear"]
    y_ref, dx_ref, kept_ref = out["frozen_linear_reference"]
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)  # the same products
    assert [t.dtype for t in kept] == [torch.bfloat16]  # the stored weight itself
    assert any(t.dtype == dtype and t.numel() == w.numel() for t in kept_ref)  # the reference: its copy
    with pytest.raises(ValueError, match="frozen"):
        frozen_linear.frozen_linear(x0, w.clone().requires_grad_(True), b)


@pytest.mark.parametrize("base,extra,match", [
    ("mxfp4", ["parallel.ep_size=2"], "one process only"),
    ("bf16", ["model.moe.precision=mxfp8", 'train.lora.targets=["attn"]'], "model.moe.precision"),
    ("bf16", ["parallel.ep_size=2", "parallel.replicate_hot_experts=1", 'train.lora.targets=["attn"]'],
     "replicate_hot_experts"),
    ("nvfp4", ["model.moe.d_expert=40"], "model.moe.d_expert=40 is not a multiple"),
])
def test_refusals_name_the_field(base: str, extra: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=rf"train\.lora\.base='{base}'.*{match}"):
        cfg_of(base, ALL, *extra)


def test_a_packed_base_is_planned_for_one_process_only() -> None:
    from dropless.plan.model import plan

    with pytest.raises(ValueError, match="train.lora.base='mxfp4'.*--world 2"):
        plan(cfg_of("mxfp4"), 2)


def test_packing_refuses_trainable_experts() -> None:
    """A model whose experts train (built without train.lora) is not packed behind its back."""
    cfg = load_config(preset_path("tiny"), SIZES)
    model = MoEModel(cfg.model, seed=0)
    with pytest.raises(ValueError, match="train.lora.base='mxfp4'"):
        frozen_base.pack_frozen_base(model, "mxfp4")


@pytest.mark.parametrize("base", ["bf16", "mxfp4"])
def test_merge_holds_the_unadapted_experts_too(base: str) -> None:
    """Experts with no adapters (here: targets without "experts"; in a run also an MTP block's, or
    those outside train.lora.layers) are packed buffers the state dict does not hold: the merged
    state carries their dequantised values, so the plain model loads it strictly and computes what
    the adapted model computes."""
    from dropless.hf.merge_lora import merged_state

    model = build(base, '["attn"]')
    frozen_base.pack_frozen_base(model, base)
    state = merged_state(model)
    cfg = cfg_of(base, '["attn"]')
    plain = MoEModel(cfg.model, seed=1)
    plain.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert_close(plain(tokens()).logits, model(tokens()).logits, REFERENCE[torch.float32])
