"""Routing replay with multi-token prediction: a record of unequal sequences is right-padded (input
0, ignored target), and padding must not be trained on (layers/mtp.py): each module's loss is the
mean over its real (input, target) pairs, and a module with none in the batch is left out of the
mean over modules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dropless.expert_slots import ExpertSlots
from dropless.model import MoEModel
from dropless.train.loop import Trainer
from dropless.data.replay import IGNORE_INDEX, ReplayData
from test_replay_training import CFG, expert_01_record
from tiny_run import rows, tiny
from tolerances import assert_close


def per_module_sums(model: MoEModel, xs: torch.Tensor, ys: torch.Tensor, ids_LSK: torch.Tensor,
                    depth: int) -> list[tuple[torch.Tensor, int]]:
    """One unpadded sequence: per MTP module k, (summed cross-entropy, count) over its n - k
    positions, module k at position t reading token t+k and predicting token t+1+k (test_mtp.py's
    reference); h_0 is the final norm's input, taken in eval mode, where the modules do not run (the
    model refuses them a sequence of depth positions or fewer)."""
    seen: list[torch.Tensor] = []
    hook = model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    model.eval()
    model(xs[None], ys[None], replay_ids=[ids[None] for ids in ids_LSK])
    model.train()
    hook.remove()
    full = torch.cat([xs[:1], ys])[None]  # tokens 0..n
    n, h, out = xs.numel(), seen[0], []
    for k, m in enumerate(model.mtp[:depth], start=1):
        if n - k < 1:
            out.append((torch.zeros(()), 0))
            continue
        e = model.embed(full[:, k:n])
        z = m.proj(torch.cat([m.embed_norm(e), m.hidden_norm(h[:, :n - k])], dim=-1))  # DeepSeek's order
        h = m.block(z, model.rope_cos[:n - k], model.rope_sin[:n - k]).x
        logits = model.head(m.out_norm(h)).float()[0]
        out.append((F.cross_entropy(logits, full[0, k + 1:n + 1], reduction="sum"), n - k))
    return out


@pytest.mark.parametrize("depth,lengths", [
    (1, [33, 12, 20]), (2, [33, 12, 20]),
    (2, [3, 2]),  # inputs 2 and 1: module 1 has one real pair, module 2 none (left out, not NaN)
])
def test_padded_mtp_loss_is_the_mean_over_real_pairs(tmp_path: Path, depth: int, lengths: list[int]) -> None:
    cfg = tiny(*CFG, f"train.batch_size={len(lengths)}", f"model.mtp_depth={depth}")
    expert_01_record(tmp_path / "r.rec", lengths=lengths)
    data = ReplayData(tmp_path / "r.rec", cfg, ExpertSlots.from_config(cfg.model.moe), torch.device("cpu"))
    x, y, ids = data.batch(0, 0)
    assert x.shape[1] >= depth + 1 and (y == IGNORE_INDEX).any()
    torch.manual_seed(0)
    model = MoEModel(cfg.model)
    out = model(x, y, replay_ids=ids)
    assert torch.isfinite(out.loss) and out.mtp_loss is not None
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        per_seq = [per_module_sums(model, *data.seqs[i], depth) for i in data.indices(0, 0)]
    losses = []
    for k in range(depth):
        total, count = sum(s[k][0] for s in per_seq), sum(s[k][1] for s in per_seq)
        if count:
            losses.append(total / count)
    want = torch.stack(losses).mean()
    # another batch composition: GEMM rows may round differently (test_replay_training.py's padding test)
    assert_close(out.mtp_loss.detach(), want, msg=f"depth {depth}, lengths {lengths}")


@pytest.mark.parametrize("depth", [1, 2])
def test_replay_training_with_mtp_on_unequal_sequences(tmp_path: Path, depth: int) -> None:
    expert_01_record(tmp_path / "r.rec", lengths=[33, 12, 20, 7, 28])
    run = tmp_path / "run"
    Trainer(tiny(*CFG, "train.batch_size=3", "train.steps=4", f"model.mtp_depth={depth}",
                 f"data.replay_routing={tmp_path / 'r.rec'}"), run).fit()
    train_rows = rows(run, "mtp_loss")
    assert len(train_rows) == 4
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0
               for r in train_rows)
