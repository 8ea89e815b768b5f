"""generate(): the KV-cache path gives the recompute path's tokens (greedy, batched prompts of
different lengths and one prompt); sampling filters on hand-made logits; stop sequences; streaming;
the routing record; argument validation."""

from __future__ import annotations

import math

import pytest
import torch

from dropless.model import MoEModel
from dropless.serve.generate import generate
from dropless.serve.sampling import Sampling, apply_repetition_penalty, filter_top_k, filter_top_p
from dropless.data.tokenizer import ByteTokenizer
from test_kv_cache import small_model

PROMPTS = [[5, 17, 3, 40, 22, 9, 31, 2, 11, 60, 7], [33], [8, 8, 51, 19, 44]]


def distinct_enough(tokens: list[list[int]]) -> None:
    # a degenerate model (one token repeated) would make path equality say nothing about the cache
    for t in tokens:
        assert len(set(t)) >= 5, f"too repetitive to test anything: {t}"


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["batch_left_padded", "one"])
@pytest.mark.parametrize("penalty", [1.0, 4.0])
def test_greedy_cache_equals_recompute(prompts: list[list[int]], penalty: float) -> None:
    model = small_model()
    kw = dict(temperature=0, repetition_penalty=penalty, record_routing=True)
    cached = generate(model, prompts, 16, **kw)
    ref = generate(model, prompts, 16, use_cache=False, **kw)
    assert cached.tokens == ref.tokens
    if penalty > 1:
        distinct_enough(cached.tokens)
        # a prompt's tokens do not depend on the batch it ran in (left padding changes nothing)
        assert generate(model, prompts[-1:], 16, **kw).tokens[0] == cached.tokens[-1]
    # routing record: prompt + generated tokens, as the full forward of that sequence routes them
    for i, p in enumerate(prompts):
        seq = torch.tensor(p + cached.tokens[i]).unsqueeze(0)
        with torch.no_grad():
            full = torch.stack([m.ids_TK for m in model(seq).moe])
        assert cached.routing[i].shape == (2, len(p) + 16, 2)
        assert torch.equal(cached.routing[i], full)
        assert torch.equal(ref.routing[i], full)


def test_sampling_cache_equals_recompute() -> None:
    # both paths draw from the generator in the same order: equal logits, equal samples
    model = small_model(1)
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=5)
    a = generate(model, PROMPTS, 12, **kw)
    assert a.tokens == generate(model, PROMPTS, 12, use_cache=False, **kw).tokens
    assert a.tokens != generate(model, PROMPTS, 12, **{**kw, "seed": 6}).tokens


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda p: (~filter_top_p(logits, p).isinf()).nonzero()[:, 1].tolist()  # noqa: E731
    assert kept(0.4) == [0]  # the top token alone already has 0.5 >= 0.4
    assert kept(0.75) == [0, 1]  # 0.5 < 0.75, 0.8 >= 0.75
    assert kept(0.85) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]
    # the boundary: a set whose mass equals p exactly is enough (dyadic probabilities 1/2, 1/4, 1/8,
    # 1/8: softmax and the running sums are exact in float32, checked here)
    dyadic = torch.tensor([[0.0, -1.0, -2.0, -2.0]]) * math.log(2)
    assert torch.equal(torch.softmax(dyadic, -1), torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    assert (~filter_top_p(dyadic, 0.75).isinf()).nonzero()[:, 1].tolist() == [0, 1]
    # unsorted input: the filter follows probability, not position
    perm = torch.tensor([2, 0, 3, 1])
    assert (~filter_top_p(logits[:, perm], 0.75).isinf()).nonzero()[:, 1].tolist() == [1, 3]


def test_top_k_and_repetition_penalty() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    assert (~filter_top_k(logits, 2).isinf()).nonzero()[:, 1].tolist() == [0, 2]
    seen = torch.tensor([[True, True, False, False]])
    # positive seen logits divided, negative seen multiplied, unseen untouched
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0, 0.5]]


def test_repetition_penalty_covers_the_prompt() -> None:
    # the first generated token is already penalised for the prompt's tokens
    model = small_model()
    changed = 0
    for p in PROMPTS:
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0, -1]
        seen = torch.zeros(1, 64, dtype=torch.bool)
        seen[0, p] = True
        expected = int(apply_repetition_penalty(logits.unsqueeze(0), seen, 4.0).argmax())
        assert generate(model, [p], 1, temperature=0, repetition_penalty=4.0).tokens == [[expected]]
        changed += expected != int(logits.argmax())
    assert changed, "the penalty changed no pick: the test would not see a missing prompt penalty"


def test_stop_sequences_cut_and_never_streamed() -> None:
    model = small_model()
    free = generate(model, PROMPTS, 16, temperature=0, repetition_penalty=4.0).tokens
    stop = free[0][6:8]  # a sequence the first prompt reaches after 8 tokens
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    out = generate(model, PROMPTS, 16, temperature=0, repetition_penalty=4.0, stop=[stop],
                   on_token=lambda i, t: streamed[i].append(t), record_routing=True)
    first = next(n for n in range(len(free[0])) if free[0][n:n + 2] == stop)
    assert out.tokens[0] == free[0][:first] and out.finish[0] == "stop"
    for i in range(3):
        assert streamed[i] == out.tokens[i]  # stop tokens never reached the stream
        assert out.routing[i].shape[1] == len(PROMPTS[i]) + len(out.tokens[i])
    # a stop string is matched through the tokenizer (bytes here)
    text_stop = bytes(free[1][3:5]).decode("latin-1")
    if all(t < 128 for t in free[1][3:5]):
        s = generate(model, PROMPTS[1:2], 16, temperature=0, repetition_penalty=4.0, stop=[text_stop],
                     tokenizer=ByteTokenizer())
        assert s.finish == ["stop"] and len(s.tokens[0]) <= 3


def test_length_finish_and_zero_tokens() -> None:
    model = small_model()
    out = generate(model, PROMPTS, 3, temperature=0)
    assert out.finish == ["length"] * 3 and all(len(t) == 3 for t in out.tokens)
    assert generate(model, PROMPTS, 0).tokens == [[], [], []]
    rec = generate(model, PROMPTS, 0, record_routing=True)
    assert [r.shape[1] for r in rec.routing] == [len(p) for p in PROMPTS]


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(max_new_tokens=60), "max_new_tokens=60"),  # 11 + 60 > max_seq_len 64 with the cache
    (dict(prompts=[[1, 64]]), "token 64"),
    (dict(prompts=[]), "prompts"),
    (dict(stop=[[]]), "stop"),
    (dict(stop=["ab"]), "needs a tokenizer"),
])
def test_bad_arguments_name_the_field(kw: dict, match: str) -> None:
    args = dict(prompts=PROMPTS, max_new_tokens=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        generate(small_model(), args.pop("prompts"), args.pop("max_new_tokens"), **args)


def test_recompute_path_crops_long_contexts() -> None:
    # without the cache, a context past max_seq_len slides (what `dropless generate` always did)
    out = generate(small_model(), [list(range(60))], 8, temperature=0, use_cache=False)
    assert len(out.tokens[0]) == 8


def test_record_routing_refused_for_masked_strategies() -> None:
    from dropless.config import RouterConfig

    model = small_model(router=RouterConfig(strategy="expert_choice", score_func="sigmoid"))
    with pytest.raises(ValueError, match="expert_choice"):
        generate(model, PROMPTS, 2, record_routing=True, use_cache=False)
    assert len(generate(model, PROMPTS, 2, use_cache=False).tokens[0]) == 2  # generation itself runs


@pytest.mark.parametrize("moe", [dict(router={"strategy": "expert_choice", "score_func": "sigmoid"}),
                                 dict(router={"strategy": "forced_balance"}),
                                 dict(capacity_factor=1.0), dict(precision="nvfp4")],
                         ids=["expert_choice", "forced_balance", "capacity", "nvfp4"])
def test_cache_refused_where_routing_depends_on_the_call(moe: dict) -> None:
    """Expert choice, forced balance (a random draw balanced over the call's tokens) and a
    capacity-limited layer route among all the tokens of a call: a one-token decode step (or a prompt
    beside others) meets other experts than the full forward. NVFP4 experts scale their input by the
    amax of all the call's rows, so a one-token step quantises differently (logits 1e-2 apart, far
    above the cache's tolerance). The cache is refused for them, naming the field; the recompute path
    (each sequence alone) runs."""
    from dropless.config import RouterConfig

    if "router" in moe:
        moe = dict(router=RouterConfig(**moe["router"]))
    model = small_model(**moe)
    with pytest.raises(ValueError, match="strategy='expert_choice'|strategy='forced_balance'|capacity_factor|"
                                         "precision='nvfp4'"):
        generate(model, PROMPTS, 2)
    assert len(generate(model, PROMPTS, 2, use_cache=False).tokens[0]) == 2


def test_sampling_dataclass_matches_generate_checks() -> None:
    with pytest.raises(ValueError, match="--top-k"):
        Sampling(top_k=0)
    assert isinstance(small_model(), MoEModel)


def test_recorded_routing_replays_in_a_training_forward() -> None:
    # the record is a plain tensor (not an inference-mode one): a forward with backward can replay it
    # and routes exactly as recorded
    model = small_model()
    out = generate(model, PROMPTS[:1], 6, temperature=0, record_routing=True)
    seq = torch.tensor(PROMPTS[0] + out.tokens[0]).unsqueeze(0)
    replay = [ids.unsqueeze(0) for ids in out.routing[0]]
    res = model(seq[:, :-1], seq[:, 1:], replay_ids=[r[:, :-1] for r in replay])
    res.loss.backward()
    assert all(torch.equal(m.ids_TK, r[0, :-1]) for m, r in zip(res.moe, replay))
