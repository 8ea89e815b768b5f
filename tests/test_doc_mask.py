"""Document masking for packed sequences (layers/doc_mask.py, `MoEModel.forward(segments_BS=)`).

The exactness property: a window packing several documents gives each document the logits, the
cross-entropy sum, the MTP loss sum and the parameter gradients of that document run alone through
the same model (positions from 0), up to the reduction order of other batch shapes (DOC_MASK in
tolerances.py). Checked for multi-head, grouped-query (with head_dim and q/k norm) and latent
attention, the parallel MoE block, recompute, offload and MTP. Without segments the same window is
far from it, so the property fails when the mask is dropped. It cannot see positions that fail to
restart: rotary attention depends on position differences only, so a document shifted by its
offset scores the same up to the rounding of the tables; `test_positions_restart_at_each_document`
checks them directly.

fp32 on the CPU: the dense-mask path. The flex BlockMask path (CUDA) is checked against it by its
forward, which flex runs on the CPU without grad.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dropless.config import ModelConfig, MoEConfig
from dropless.layers import doc_mask
from dropless.layers.kv_cache import KVCache
from dropless.model import MoEModel
from tolerances import DOC_MASK, assert_close

V = 64
# Why these lengths: row 0 has three documents (boundaries at 5 and 12, mid-row), row 1 two of
# unequal length; every document has >= 3 tokens so the MTP module (depth 1) has a target in each.
DOCS = [[5, 7, 4], [9, 7]]
S = 16

ATTENTION = {
    "mha": dict(n_heads=4),
    # grouped-query with an explicit head width and q/k norm (Qwen3's layout)
    "gqa": dict(n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True),
    # latent attention: value width != query/key width, a query rank, its own softmax scale
    "mla": dict(n_heads=4, attention="mla", q_lora_rank=16, kv_lora_rank=8, head_dim=16, rope_head_dim=8,
                v_head_dim=8),
}


def make_model(attn: str, **over: object) -> MoEModel:
    # init_std 0.5: logits spread over several units, so a leak across documents moves them visibly
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, max_seq_len=32, n_dense_layers=1,
                      d_ff_dense=64, init_std=0.5, moe=MoEConfig(num_experts=4, top_k=2, d_expert=32),
                      **ATTENTION[attn])
    torch.manual_seed(0)
    return MoEModel(replace(cfg, **over))


def documents() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, V, (n,), generator=g) for n in row] for row in DOCS]


def doc_targets(doc: torch.Tensor) -> torch.Tensor:
    """The next token inside the document; the last takes no loss (what the pipeline writes)."""
    return torch.cat([doc[1:], torch.tensor([doc_mask.IGNORE_INDEX])])


def packed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, targets, segments) [2, S]; segment ids are arbitrary non-decreasing values."""
    docs = documents()
    tokens = torch.stack([torch.cat(row) for row in docs])
    targets = torch.stack([torch.cat([doc_targets(d) for d in row]) for row in docs])
    segments = torch.stack([torch.cat([torch.full((len(d),), 10 * b + 3 * j) for j, d in enumerate(row)])
                            for b, row in enumerate(docs)])
    return tokens, targets, segments


def spans() -> list[tuple[int, int, int]]:
    out = []
    for b, row in enumerate(DOCS):
        start = 0
        for n in row:
            out.append((b, start, start + n))
            start += n
    return out


def objective(model: MoEModel, out, targets: torch.Tensor, n_mtp: int) -> torch.Tensor:
    """Summed (not averaged) losses, so documents add up: the CE sum over the logits, plus the MTP
    loss times its count of targets (one module: its mean over the n_mtp positions with a target)."""
    ce = F.cross_entropy(out.logits.float().reshape(-1, V), targets.reshape(-1), reduction="sum")
    return ce + out.mtp_loss * n_mtp if out.mtp_loss is not None else ce


def grads(model: MoEModel, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {
    "mha": ("mha", {}),
    "gqa": ("gqa", {}),
    "mla": ("mla", {}),
    "mha_parallel_moe": ("mha", dict(block="parallel_moe")),
    "gqa_recompute_layer": ("gqa", dict(recompute=["layer"])),
    "mla_recompute_attn_moe": ("mla", dict(recompute=["attn", "moe"])),
    "mha_offload_attn": ("mha", dict(offload=["attn"])),
    "mha_mtp": ("mha", dict(mtp_depth=1)),
    "mla_mtp_moe_recompute": ("mla", dict(mtp_depth=1, mtp_block="moe", recompute=["layer"])),
}


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_documents_alone(case: str) -> None:
    attn, over = CASES[case]
    model = make_model(attn, **over).train()
    tokens, targets, segments = packed()
    mtp = model.cfg.mtp_depth > 0
    out = model(tokens, targets, segments_BS=segments)
    assert (out.mtp_loss is not None) == mtp  # with segments the MTP modules run
    n_mtp = {(b, s): (e - s - 2) for b, s, e in spans()}  # module 1: positions t with t + 2 in the doc
    got = grads(model, objective(model, out, targets, sum(n_mtp.values())))

    want_loss, want_ce_sum, want_mtp_sum = torch.zeros(()), torch.zeros(()), torch.zeros(())
    for (b, s, e), doc in zip(spans(), [d for row in documents() for d in row]):
        alone = model(doc[None], doc_targets(doc)[None])
        assert_close(out.logits[b, s:e], alone.logits[0], DOC_MASK, msg=f"{case} logits of doc {b}:{s}:{e}")
        want_loss = want_loss + objective(model, alone, doc_targets(doc)[None], n_mtp[(b, s)])
        want_ce_sum = want_ce_sum + alone.ce_loss * (e - s - 1)
        if mtp:
            want_mtp_sum = want_mtp_sum + alone.mtp_loss * n_mtp[(b, s)]
    want = grads(model, want_loss)
    n_ce = int((targets != doc_mask.IGNORE_INDEX).sum())
    assert_close(out.ce_loss * n_ce, want_ce_sum, DOC_MASK, msg=f"{case} CE sum")
    if mtp:
        assert_close(out.mtp_loss * sum(n_mtp.values()), want_mtp_sum, DOC_MASK, msg=f"{case} MTP sum")
    assert got.keys() == want.keys()
    for name in got:
        assert_close(got[name], want[name], DOC_MASK, msg=f"{case} grad {name}")


@pytest.mark.parametrize("attn", ATTENTION)
def test_without_segments_documents_leak(attn: str) -> None:
    """The property's other side: the same window unmasked (positions 0..S-1, one causal sequence)
    moves every later document's logits by far more than DOC_MASK allows; the first document of
    a row is unaffected (causal), which is why only later ones are compared."""
    model = make_model(attn).eval()
    tokens, targets, segments = packed()
    with torch.no_grad():
        plain = model(tokens).logits
        masked = model(tokens, segments_BS=segments).logits
        for b, s, e in spans():
            if s > 0:
                assert float((plain[b, s:e] - masked[b, s:e]).abs().max()) > 1000 * DOC_MASK.atol


def test_no_target_left_gives_zero_not_nan() -> None:
    model = make_model("mha", mtp_depth=1).train()
    tokens, _, segments = packed()
    targets = torch.full_like(tokens, doc_mask.IGNORE_INDEX)
    out = model(tokens, targets, segments_BS=segments)
    assert float(out.ce_loss.detach()) == 0.0 and float(out.mtp_loss.detach()) == 0.0
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_positions_restart_at_each_document() -> None:
    _, _, segments = packed()
    want = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    assert torch.equal(doc_mask.positions_of(segments), want)


@pytest.mark.parametrize("attn", ATTENTION)
def test_block_mask_forward_equals_dense(attn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA form of the mask (flex attention over a BlockMask) against the dense SDPA mask, by
    the forward flex runs on the CPU without grad; the MTP module's own masks included."""
    model = make_model(attn, mtp_depth=1).train()
    tokens, targets, segments = packed()
    with torch.no_grad():
        dense = model(tokens, targets, segments_BS=segments)
        monkeypatch.setattr(doc_mask, "uses_flex", lambda device, widths: True)
        flex = model(tokens, targets, segments_BS=segments)
    assert isinstance(doc_mask.doc_mask(segments, True), doc_mask.BlockMask)
    assert_close(flex.logits, dense.logits, DOC_MASK, msg="logits")
    assert_close(flex.mtp_loss, dense.mtp_loss, DOC_MASK, msg="MTP loss")


def test_compiled_packed_forward_has_no_graph_break() -> None:
    """fullgraph=True: a graph break (a host read of the segments, an untraceable op) is an error.
    Dense blocks only: torch's tracing rule for grouped_mm takes bf16 only (tests/test_compile.py)."""
    model = make_model("gqa", n_dense_layers=2, mtp_depth=1).train()
    tokens, targets, segments = packed()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        want = model(tokens, targets, segments_BS=segments)
        got = compiled(tokens, targets, segments_BS=segments)
    assert_close(got.logits, want.logits, DOC_MASK, msg="logits")
    assert_close(got.loss, want.loss, DOC_MASK, msg="loss")


def test_refusals() -> None:
    model = make_model("mha").eval()
    tokens, _, segments = packed()
    cache = KVCache.for_model(model, tokens.shape[0], S)
    with pytest.raises(ValueError, match="segments_BS with cache"):
        model(tokens, segments_BS=segments, cache=cache)
    with pytest.raises(ValueError, match="segments_BS with positions_BS"):
        model(tokens, segments_BS=segments, positions_BS=doc_mask.positions_of(segments))
    with pytest.raises(ValueError, match=r"segments_BS of shape \(2, 15\)"):
        model(tokens, segments_BS=segments[:, 1:])
    with pytest.raises(ValueError, match="segments_BS of dtype torch.float32"):
        model(tokens, segments_BS=segments.float())
    assert cache.length == 0  # refused before anything was written
