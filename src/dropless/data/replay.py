"""Training on a routing record (routing replay, R3): the record's sequences are the training data and
each MoE layer's forward takes the record's expert ids instead of choosing its own.

Legend: B sequences per micro-batch, S the batch's longest input, L MoE layers, K experts per token,
N sequences in the record, E selectable experts (the record's id range).

The RL case: a rollout engine sampled these sequences and recorded its routing; the trainer learns
from exactly those tokens through exactly those experts, with its own router's scores at the
recorded ids for the combine weights (router.py `_imposed`), so the router still gets a gradient.

Inputs and targets. A sequence of S tokens whose first R were routed trains on inputs tokens[:n],
targets tokens[1:n+1] with n = min(R, S - 1): every input position has recorded ids, every target a
token. Sequences with n = 0 are dropped (with a count in `ReplayData.describe`).

Batching. `train.batch_size` sequences per micro-batch, right-padded to the longest of them. Padded
positions get input token 0, target -100 (cross-entropy's ignore_index: the loss is the mean over
real targets) and ids spread round-robin over the experts ((p * K + k) mod E at position p). The
model is causal and routes each token alone, so padding after a sequence cannot change its real
tokens' outputs; it does enter what is averaged over every position of the micro-batch: the
balancing losses (aux, z, sequence aux), the routing statistics and their counts (round-robin ids
keep those balanced). A record of equal-length sequences has no padding. With model.mtp_depth D
the MTP modules embed the input tokens (a padded one is id 0) and train where the target is real
(layers/mtp.py); a batch is padded to at least D + 1 positions, which module D needs.

Order. Slot j of micro-batch m of step s takes the record's sequence at position
g = ((s - s0) * A * W + m) * B + j (A = train.grad_accum, W processes, m the one-process micro index
of train/data_source.py), through a permutation of the N sequences drawn from (train.seed, epoch
g // N): every sequence once per epoch. It is a pure function of the step, so a resumed run draws the
same batches without a sampler state. `s0` is the step at which this record started: 0 for a new
run; a resume that brings a different record (the next RL iteration, same path or another) starts it
at the resumed step, from its first epoch (the checkpoint keeps the record's fingerprint and `s0`).

Config fields: train.batch_size, grad_accum, steps, seed, the optimizer and schedule apply as usual;
train.seq_len applies only to evaluation (validation on the run's data split, the router choosing);
sequences longer than model.max_seq_len are refused. The record must match the model: MoE layer
order, K, E (the selectable experts, identity experts included: their ids replay like any other),
vocabulary (RoutingRecord.check_model names the field); strategies with a variable
number of experts per token (expert_choice, expert_threshold) cannot replay K choices and are refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..expert_slots import ExpertSlots
from .routing_record import VARIABLE_COUNT_STRATEGIES, RoutingRecord
from ..device import to_device
from ..layers.doc_mask import IGNORE_INDEX  # a padded target takes no loss


class ReplayData:
    def __init__(self, path: str | Path, cfg: RunConfig, slots: ExpertSlots, device: torch.device,
                 micro_per_step: int = 0) -> None:
        """`slots`: the model's (`MoEModel.expert_slots()`), the range the record's ids must have;
        `micro_per_step`: micro-batches per optimizer step over all processes (A * W; default A)."""
        strategy = cfg.model.moe.router.strategy
        if strategy in VARIABLE_COUNT_STRATEGIES:
            raise ValueError(f"model.moe.router.strategy={strategy!r}: routing replay imposes K experts "
                             "per token; this strategy chooses a variable number")
        norm_top_k = cfg.model.moe.router.norm_top_k
        if norm_top_k is not None:  # (the router refuses it at the first replayed forward: too late)
            raise ValueError(f"model.moe.router.norm_top_k={norm_top_k} with data.replay_routing={path}: routing "
                             f"replay takes the weights over the replayed top_k={cfg.model.moe.top_k} ids only; "
                             "unset norm_top_k")
        rec = RoutingRecord.load(path)
        rec.check_model(cfg.model, slots, what=f"data.replay_routing={path}")
        self.path = str(path)
        self.fingerprint = rec.fingerprint()
        self.source = rec.source
        self.device = device
        self.seed = cfg.train.seed
        self.batch_size = cfg.train.batch_size
        self.K, self.E = rec.top_k, rec.num_experts
        self.seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # x_S, y_S, ids_LSK
        for tok_S, ids_LRK in zip(rec.tokens, rec.ids):
            n = min(ids_LRK.shape[1], tok_S.numel() - 1)
            if n >= 1:
                self.seqs.append((tok_S[:n], tok_S[1:n + 1], ids_LRK[:, :n]))
        self.dropped = len(rec.tokens) - len(self.seqs)
        if not self.seqs:
            raise ValueError(f"data.replay_routing={path}: no sequence with a routed token and a target")
        longest = max(x.numel() for x, _, _ in self.seqs)
        if longest > cfg.model.max_seq_len:
            raise ValueError(f"data.replay_routing={path}: a sequence of {longest} inputs exceeds "
                             f"model.max_seq_len={cfg.model.max_seq_len}")
        # the MTP modules need more positions than modules (layers/mtp.py); the extra ones are padding
        self.min_len = cfg.model.mtp_depth + 1
        self.start_step = 0
        self.micro_per_step = micro_per_step or cfg.train.grad_accum

    def describe(self) -> str:
        skipped = f", {self.dropped} without a target skipped" if self.dropped else ""
        return (f"routing replay: {len(self.seqs)} sequences ({self.tokens_per_sequence():.1f} inputs each "
                f"on average{skipped}) from {self.path} ({self.source}), from step {self.start_step}")

    def tokens_per_sequence(self) -> float:
        return sum(x.numel() for x, _, _ in self.seqs) / len(self.seqs)

    # --- the checkpoint's part: which record, since which step -----------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "start_step": self.start_step}

    def resume(self, state: dict[str, Any] | None, step: int) -> str | None:
        """Continue the record's order from a checkpoint at `step`; a record other than the saved
        one (or a run that trained on its data split so far) starts at `step`. Returns a note."""
        if state and state.get("fingerprint") == self.fingerprint:
            self.start_step = int(state["start_step"])
            return None
        self.start_step = step
        return (f"routing replay: {self.path} is not the record this run trained on before step {step}; "
                f"it starts at step {step} from its first sequence")

    # --- batches -------------------------------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        digest = hashlib.sha256(f"replay:{self.seed}:{epoch}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
        return torch.randperm(len(self.seqs), generator=g)

    def indices(self, step: int, micro_index: int) -> list[int]:
        """The record's sequences in (step, micro_index): the order of the module note."""
        N, B = len(self.seqs), self.batch_size
        first = ((step - self.start_step) * self.micro_per_step + micro_index) * B
        out, cache = [], {}
        for g in range(first, first + B):
            epoch = g // N
            if epoch not in cache:
                cache[epoch] = self._order(epoch)
            out.append(int(cache[epoch][g % N]))
        return out

    def batch(self, step: int, micro_index: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(x_BS, y_BS, per MoE layer ids_BSK), int64, on the device; right-padded (module note)."""
        chosen = [self.seqs[i] for i in self.indices(step, micro_index)]
        S = max(max(x.numel() for x, _, _ in chosen), self.min_len)
        B, L, K, E = len(chosen), chosen[0][2].shape[0], self.K, self.E
        x_BS = torch.zeros(B, S, dtype=torch.long)
        y_BS = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
        pos_SK = torch.arange(S)[:, None] * K + torch.arange(K)
        ids_LBSK = (pos_SK % E).expand(L, B, S, K).clone()
        for b, (x, y, ids) in enumerate(chosen):
            n = x.numel()
            x_BS[b, :n], y_BS[b, :n], ids_LBSK[:, b, :n] = x, y, ids
        x_BS, y_BS, ids_LBSK = (to_device(t, self.device) for t in (x_BS, y_BS, ids_LBSK))
        return x_BS, y_BS, list(ids_LBSK.unbind(0))
