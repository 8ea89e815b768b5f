"""Generation, the Python API behind `dropless generate` (serve/generate_cli.py): prefill once, then
one token per step with a KV cache; the recompute path as the reference.

Legend: B sequences, P longest prompt, V vocabulary, L_moe MoE layers, K experts per token.

`generate(model, prompts, max_new_tokens, ...)` runs a batch of prompts of different lengths:
- use_cache=True (default): the prompts are left-padded to P and prefilled in one forward (padding
  masked out of attention, each prompt's first real token at rotary position 0); each step then
  feeds the B sampled tokens through the model once, attending to the cached keys and values
  (layers/kv_cache.py). Positions must stay inside the rotary tables: longest prompt +
  max_new_tokens <= model.max_seq_len.
- use_cache=False: the reference, and what `dropless generate` did before: each step recomputes
  every sequence's whole context on its own (no padding; a context longer than max_seq_len keeps its
  last max_seq_len tokens, a sliding window). Sampling consumes the generator identically in both
  paths, so equal logits give equal tokens.
The two paths run different batch shapes through the BLAS, so their logits agree to the fp32 noise
floor, not bit for bit (docs/numerics.md); greedy tokens agree unless two logits are that close.
The cache is refused for models whose routing depends on the other tokens of a call (expert choice;
forced balance, a random draw balanced over the call's tokens; a capacity-limited layer): a one-token
step would meet other experts than the full forward. So is NVFP4 expert precision, whose per-tensor
input scale is taken over the call's rows.

Stop sequences (token id lists, or strings encoded with the tokenizer: the byte tokenizer matches
strings exactly; a BPE tokenizer may spell the same text with other tokens, which is not caught) end
a sequence when its generated tokens end with one. The stop sequence is cut from the result and never
streamed: `on_token(i, token)` receives a token once no stop sequence can still start at or before it.
An empty prompt starts from token 0 (the byte tokenizer has no BOS; NUL stands in).

record_routing: the result holds, per sequence, the expert ids of every MoE layer for every token of
prompt + returned tokens (int64 [L_moe, n_tokens, K], CPU): prompt tokens from the prefill, each
generated token from the step that fed it (one extra step feeds the last sampled token), padding
excluded. Strategies whose decisions carry a validity mask (expert_choice, expert_threshold) are
refused: their choice depends on the batch, which a record of ids cannot replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..layers.kv_cache import KVCache
from ..model import MoEModel
from .evaluate import autocast
from .sampling import Sampling, sample_next

MASKED_STRATEGIES = ("expert_choice", "expert_threshold")
# routed among all the tokens of a call: the cache's one-token steps would meet other experts
CALL_ROUTED_STRATEGIES = ("expert_choice", "forced_balance")


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # generated ids per prompt (stop sequence cut)
    finish: list[str]  # "stop" or "length" per prompt
    routing: list[torch.Tensor] | None = None  # record_routing: int64 [L_moe, n_tokens, K] per prompt
    prompt_lens: list[int] = field(default_factory=list)  # tokens of each prompt as fed (empty -> 1)


class _Cached:
    """Left-padded batch: one prefill, then one forward of B tokens per step."""

    def __init__(self, model: MoEModel, prompts: list[list[int]], capacity: int) -> None:
        dev = model.embed.weight.device
        self.model, self.B, self.P = model, len(prompts), max(len(p) for p in prompts)
        self.pads = [self.P - len(p) for p in prompts]
        self.tokens_BP = torch.tensor([[0] * pad + p for pad, p in zip(self.pads, prompts)], device=dev)
        pad_B1 = torch.tensor(self.pads, device=dev).unsqueeze(1)
        col_1P = torch.arange(self.P, device=dev).unsqueeze(0)
        self.valid_BP = col_1P >= pad_B1
        self.pos_BP = (col_1P - pad_B1).clamp_min(0)
        self.next_pos_B1 = torch.tensor([len(p) for p in prompts], device=dev).unsqueeze(1)
        self.cache = KVCache.for_model(model, self.B, capacity)

    def prefill(self) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        out = self.model(self.tokens_BP, positions_BS=self.pos_BP, cache=self.cache, valid_BS=self.valid_BP)
        ids = [m.ids_TK.view(self.B, self.P, -1) for m in out.moe]
        return out.logits[:, -1], [[i[b, pad:] for i in ids] for b, pad in enumerate(self.pads)]

    def step(self, next_B: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        out = self.model(next_B.unsqueeze(1), positions_BS=self.next_pos_B1, cache=self.cache)
        self.next_pos_B1 = self.next_pos_B1 + 1
        ids = [m.ids_TK.view(self.B, 1, -1) for m in out.moe]
        return out.logits[:, -1], [[i[b] for i in ids] for b in range(self.B)]


class _Recompute:
    """The reference: every sequence's whole (cropped) context, one sequence at a time, each step."""

    def __init__(self, model: MoEModel, prompts: list[list[int]]) -> None:
        dev = model.embed.weight.device
        self.model = model
        self.ctx = [torch.tensor(p, device=dev) for p in prompts]

    def _run(self, new: int | None) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        logits, ids = [], []
        for ctx in self.ctx:
            out = self.model(ctx[-self.model.cfg.max_seq_len:].unsqueeze(0))
            logits.append(out.logits[0, -1])
            ids.append([m.ids_TK[-(new or ctx.numel()):] for m in out.moe])
        return torch.stack(logits), ids

    def prefill(self) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        return self._run(None)

    def step(self, next_B: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        self.ctx = [torch.cat([c, next_B[b:b + 1]]) for b, c in enumerate(self.ctx)]
        return self._run(1)


def stop_sequences(stop: Sequence[str | Sequence[int]] | None, tokenizer: object | None) -> list[list[int]]:
    out = []
    for s in stop or []:
        if isinstance(s, str):
            if tokenizer is None:
                raise ValueError(f"stop={s!r}: a stop string needs a tokenizer (or pass token ids)")
            ids = list(tokenizer.encode(s))
        else:
            ids = [int(i) for i in s]
        if not ids:
            raise ValueError(f"stop={s!r} (--stop): an empty stop sequence would stop at once")
        out.append(ids)
    return out


def _held(tokens: list[int], stops: list[list[int]]) -> int:
    """How many trailing tokens could still be the start of a stop sequence (not yet safe to emit)."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(tokens)), held, -1):
            if tokens[-n:] == s[:n]:
                held = n
                break
    return held


def _check(model: MoEModel, prompts: list[list[int]], max_new_tokens: int, use_cache: bool,
           record_routing: bool) -> None:
    V, S_max = model.cfg.vocab_size, model.cfg.max_seq_len
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts: need a non-empty list of token id lists, got {prompts!r:.80}")
    for i, p in enumerate(prompts):
        bad = [t for t in p if not (isinstance(t, int) and 0 <= t < V)]
        if bad:
            raise ValueError(f"prompts[{i}]: token {bad[0]!r} is not an id in [0, {V})")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} (--max-new-tokens): must be an integer >= 0")
    longest = max(max(len(p), 1) for p in prompts)
    if (use_cache or record_routing) and longest + max_new_tokens > S_max:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} (--max-new-tokens): the longest prompt ({longest} tokens) plus "
            f"the new tokens exceed model.max_seq_len={S_max}, the positions the model has; "
            + ("the recompute path (--no-cache) crops the context instead" if use_cache and not record_routing
               else "recording routing needs every token in one context"))
    moe = model.cfg.moe
    if use_cache and model.moe_layers() and (moe.router.strategy in CALL_ROUTED_STRATEGIES
                                             or moe.capacity_factor is not None):
        what = (f"model.moe.router.strategy={moe.router.strategy!r}" if moe.router.strategy in CALL_ROUTED_STRATEGIES
                else f"model.moe.capacity_factor={moe.capacity_factor}")
        raise ValueError(f"use_cache (the KV cache) with {what}: each MoE call routes among all its tokens, "
                         "so a one-token decode step (and a prompt beside others in a batch) would meet "
                         "other experts than the full forward; generate with --no-cache (use_cache=False)")
    if use_cache and model.moe_layers() and moe.precision == "nvfp4":
        # NVFP4 scales the expert GEMMs' input rows by one fp32 factor from the amax of the whole call
        # (ops/quant.py): a one-token step quantises its row against its own amax, not the sequence's
        raise ValueError("use_cache (the KV cache) with model.moe.precision='nvfp4': the experts' input "
                         "shares one per-tensor scale over all the call's rows, so a one-token decode step "
                         "quantises differently from the full forward; generate with --no-cache "
                         "(use_cache=False)")
    if record_routing and model.moe_layers() and model.cfg.moe.router.strategy in MASKED_STRATEGIES:
        raise ValueError(f"record_routing (--record-routing) with model.moe.router.strategy={model.cfg.moe.router.strategy!r}: "
                         "its choices depend on the whole batch, a record of ids cannot replay them")


def generate(model: MoEModel, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, repetition_penalty: float = 1.0,
             stop: Sequence[str | Sequence[int]] | None = None, tokenizer: object | None = None,
             seed: int | None = None, generator: torch.Generator | None = None, use_cache: bool = True,
             on_token: Callable[[int, int], None] | None = None, record_routing: bool = False,
             dtype: str = "fp32") -> GenerateResult:
    """Sample up to `max_new_tokens` per prompt (see the module docstring). `seed` seeds a fresh
    generator on the model's device (else `generator`, else torch's global one); `dtype` the
    autocast dtype of the forward ("fp32": none)."""
    s = Sampling(temperature, top_k, top_p, repetition_penalty)
    _check(model, prompts, max_new_tokens, use_cache, record_routing)
    stops = stop_sequences(stop, tokenizer)
    dev = model.embed.weight.device
    if seed is not None:
        generator = torch.Generator(dev).manual_seed(seed)
    prompts = [list(p) or [0] for p in prompts]
    B = len(prompts)
    runner = _Cached(model, prompts, max(map(len, prompts)) + max_new_tokens) if use_cache else _Recompute(model, prompts)
    seen_BV = torch.zeros(B, model.cfg.vocab_size, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        seen_BV[b, p] = True
    out_BN = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
    routing: list[list[list[torch.Tensor]]] = [[] for _ in range(B)]  # [seq][forward][layer]
    host = on_token is not None or bool(stops)  # a per-step host read only when someone needs it
    tokens: list[list[int]] = [[] for _ in range(B)]
    emitted, done = [0] * B, [False] * B
    n_out = 0

    def record(ids: list[list[torch.Tensor]]) -> None:
        if record_routing:
            for b in range(B):
                routing[b].append(ids[b])

    # inference mode, not just no_grad: ~10% off a decode step of the default model on CPU (no
    # version counters or view tracking); its tensors never leave this function (routing: see below)
    with torch.inference_mode(), autocast(dev, dtype):
        if max_new_tokens or record_routing:
            logits_BV, ids = runner.prefill()
            record(ids)
        for n in range(max_new_tokens):
            next_B = sample_next(logits_BV, seen_BV, s, generator)
            out_BN[:, n] = next_B
            n_out = n + 1
            seen_BV.scatter_(1, next_B.unsqueeze(1), True)
            if host:
                last = n + 1 == max_new_tokens
                for b, t in enumerate(next_B.tolist()):
                    if done[b]:
                        continue
                    tokens[b].append(t)
                    hit = next((st for st in stops if tokens[b][-len(st):] == st), None)
                    if hit is not None:
                        del tokens[b][-len(hit):]
                        done[b] = True
                    safe = len(tokens[b]) - (0 if done[b] or last else _held(tokens[b], stops))
                    if on_token is not None:
                        for tok in tokens[b][emitted[b]:safe]:
                            on_token(b, tok)
                    emitted[b] = max(emitted[b], safe)
                if all(done):
                    break  # every kept token was fed already: a stop sequence is never empty
            if n + 1 < max_new_tokens or record_routing:  # the last token is fed only to record it
                logits_BV, ids = runner.step(next_B)
                record(ids)
    if not host:
        tokens = out_BN[:, :n_out].tolist()
    finish = ["stop" if d else "length" for d in done]
    result = GenerateResult(tokens, finish, None, [len(p) for p in prompts])
    if record_routing:
        result.routing = []
        for b in range(B):
            per_layer = [torch.cat([f[i] for f in routing[b]]) for i in range(len(model.moe_layers()))]
            n_tok = len(prompts[b]) + len(tokens[b])
            # stacked outside inference mode: a normal tensor, which a training forward may save for
            # backward (replayed ids index the router's scores)
            result.routing.append(torch.stack(per_layer)[:, :n_tok].cpu() if per_layer
                                  else torch.zeros(0, n_tok, 0, dtype=torch.long))
    return result
