"""The KV-cache forward against the full forward: logits at every prompt and decode position, for a
left-padded batch of prompts of different lengths and for one prompt; padding cannot reach a real
token; the training call is the plain causal forward."""

from __future__ import annotations

import pytest
import torch

from dropless.config import ModelConfig, MoEConfig
from dropless.layers.kv_cache import KVCache
from dropless.model import MoEModel
from tolerances import KV_DECODE, assert_close


def small_model(seed: int = 0, **moe) -> MoEModel:
    # init_std 0.5: logits spread over several units, so greedy choices are far from ties (the
    # generate tests rely on it); 3 layers, the first dense: attention, a dense MLP and MoE all cached
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=64, n_dense_layers=1,
                      d_ff_dense=64, init_std=0.5,
                      moe=MoEConfig(num_experts=4, top_k=2, d_expert=32, **moe))
    return MoEModel(cfg).eval()


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    P = max(p.numel() for p in prompts)
    pads = [P - p.numel() for p in prompts]
    # padding ids differ from 0 on purpose (63): a leak of padding would change real tokens' logits
    tokens = torch.stack([torch.cat([torch.full((pad,), 63), p]) for pad, p in zip(pads, prompts)])
    pad_B1 = torch.tensor(pads).unsqueeze(1)
    col = torch.arange(P).unsqueeze(0)
    return tokens, col >= pad_B1, (col - pad_B1).clamp_min(0), pads


def cached_logits(model: MoEModel, seqs: list[torch.Tensor], prompt_lens: list[int], steps: int
                  ) -> list[torch.Tensor]:
    """Per sequence, the logits at each of its prompt positions and then `steps` decode positions
    (feeding the sequence's own next tokens), through one prefill and `steps` cached calls."""
    tokens, valid, pos, pads = left_pad([s[:n] for s, n in zip(seqs, prompt_lens)])
    cache = KVCache.for_model(model, len(seqs), tokens.shape[1] + steps)
    with torch.no_grad():
        out = model(tokens, positions_BS=pos, cache=cache, valid_BS=valid)
        got = [[out.logits[b, pad:]] for b, pad in enumerate(pads)]
        for step in range(steps):
            nxt = torch.stack([s[n + step] for s, n in zip(seqs, prompt_lens)]).unsqueeze(1)
            out = model(nxt, positions_BS=torch.tensor(prompt_lens).unsqueeze(1) + step, cache=cache)
            for b in range(len(seqs)):
                got[b].append(out.logits[b])
    return [torch.cat(g) for g in got]


@pytest.mark.parametrize("lens", [[(20, 12), (12, 3), (16, 8)], [(15, 9)]], ids=["batch_left_padded", "one"])
def test_cached_logits_match_full_forward(lens: list[tuple[int, int]]) -> None:
    model = small_model()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 62, (n,), generator=g) for n, _ in lens]
    prompt_lens = [p for _, p in lens]
    steps = min(n - p for n, p in lens)
    got = cached_logits(model, seqs, prompt_lens, steps)
    with torch.no_grad():
        for b, s in enumerate(seqs):
            full = model(s[:prompt_lens[b] + steps].unsqueeze(0)).logits[0]  # one sequence, no padding
            assert_close(got[b], full, KV_DECODE, msg=f"sequence {b}")


def test_padding_cannot_reach_real_tokens() -> None:
    # the same batch with other padding ids gives the same real-token logits. Not bit for bit: the
    # padding rows route to other experts, so the real rows sit in other expert groups of the grouped
    # GEMM, which the BLAS rounds differently on some kernel paths (measured under
    # MKL_ENABLE_INSTRUCTIONS=AVX2; docs/numerics.md): the KV_DECODE noise floor. A padding key that
    # reached a real query moves its logits by orders of magnitude more.
    model = small_model()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 62, (n,), generator=g) for n in (9, 2, 5)]
    tokens, valid, pos, pads = left_pad(prompts)
    outs = []
    for fill in (63, 0):
        t = torch.where(valid, tokens, torch.full_like(tokens, fill))
        with torch.no_grad():
            outs.append(model(t, positions_BS=pos, valid_BS=valid,
                              cache=KVCache.for_model(model, 3, tokens.shape[1])).logits)
    assert torch.isfinite(outs[0]).all()  # padding queries see themselves: no NaN anywhere
    assert_close(outs[0][valid], outs[1][valid], KV_DECODE, msg="real tokens")
    assert not torch.equal(outs[0][~valid], outs[1][~valid])  # the padding rows themselves did change


def test_training_call_is_the_causal_forward() -> None:
    # the no-cache path with explicit positions 0..S-1 and every token valid (an explicit mask)
    # equals the training call (is_causal SDPA) to the noise floor; the training call itself takes
    # no mask and no position gather (checked by the unchanged training tests' bit-exact reruns)
    model = small_model()
    x = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(x).logits
        explicit = model(x, positions_BS=torch.arange(11).expand(2, 11),
                         valid_BS=torch.ones(2, 11, dtype=torch.bool)).logits
    assert_close(explicit, plain, KV_DECODE)


def test_cache_refuses_overflow() -> None:
    model = small_model()
    cache = KVCache.for_model(model, 1, 4)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="capacity 4"):
            model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_decode_step_and_sampling_read_nothing_on_the_host() -> None:
    # what a CUDA decode loop must not wait for: the cached forward (mask, rotary gather, cache
    # writes, the MoE gather path) and the sampler; generate() reads tokens only to stream or stop
    from dropless.serve.sampling import Sampling, sample_next
    from host_sync import forbid_host_sync

    model = small_model()
    cache = KVCache.for_model(model, 2, 8)
    tokens, valid, pos, _ = left_pad([torch.tensor([1, 2, 3]), torch.tensor([4])])
    with torch.no_grad():
        model(tokens, positions_BS=pos, cache=cache, valid_BS=valid)
        seen = torch.zeros(2, 64, dtype=torch.bool)
        with forbid_host_sync("host read in a decode step"):
            out = model(torch.tensor([[5], [6]]), positions_BS=torch.tensor([[3], [1]]), cache=cache)
            sample_next(out.logits[:, -1], seen, Sampling(0.8, 10, 0.9, 1.3), torch.Generator().manual_seed(0))
