"""The training loop: one process, gradient accumulation, autocast, evaluation, checkpoints.

Per optimizer step: `grad_accum` micro-batches (each `batch_size` x `seq_len` tokens, a pure function
of (seed, step, micro-step), so a resumed run sees the same batches; with `data.replay_routing`, a
routing record's sequences with their expert ids, replay_data.py), forward under autocast with fp32
master weights, backward of loss / grad_accum, global-norm clipping, AdamW, the learning rate from the
schedule. The MoE layers' statistics stay on the device and are summed over the step; the host reads
them (one sync) every `log.log_every` steps, together with the loss. A step whose loss or gradient
norm is not finite is skipped on the device, counted (`nonfinite_steps` in the log rows) and, after
`train.max_nonfinite_steps` in a row, stops the run (nonfinite.py).

Resume is exact: a checkpoint holds model, optimizer, step, RNG state and the routing monitor's running
sums; batches and learning rates are functions of the step; the logs are cut back to the checkpoint's
step before the run goes on. What a resumed run may change in its config: resume.py.

Distributed (a process group is initialised, e.g. by torchrun): the model is parallelised from outside
(distributed/parallelize.py: EP, then FSDP2). Rank r's micro-batch m of step s is the micro-batch
(m * W + r) that one process with W times the accumulation would draw, so W ranks with grad_accum A
follow one process with grad_accum W*A (tests/distributed/test_parallel_train.py). Health counts
are all-reduced over the ranks; the logged losses are means over ranks; only rank 0 writes files and
progress. Checkpoints are torch.distributed.checkpoint folders at every world size, one process
included (dist_checkpoint.py): written at any world size, resumable at any other. EP buffered mode's
overflow policy (skip, check, retry) is in overflow.py.

Device and dtype (`train.device`, `train.dtype`; decided once in device.py and logged with the
reason): the model is built on the CPU (the same seeded weights on every device and rank), then moved
to the device with its buffers; the optimizer state, batches, statistics and every tensor of a step
are made there. The host reads the device only on log steps, at evaluation and at checks.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import RunConfig, save_config, to_dict
from ..distributed import parallelize as par
from ..distributed.mesh import Meshes, build_meshes
from ..layers import balance
from ..distributed.watch import build_watch, watch_step
from ..model import MoEModel
from ..runs import checkpoint as ckpt
from . import compiling
from ..runs import dist_checkpoint
from .. import device as placement
from ..data.batches import eval_batches, get_batch, load_splits
from .health import TrainHealth, global_aux_terms
from .nonfinite import NonFiniteGuard
from .optim import build_optimizer, step_unless
from ..data.replay import ReplayData
from ..runs.resume import check_resume_config, optimizer_note, report_resume
from .ep_replicas_train import HotReplicas
from .overflow import OverflowGuard, build_guard
from .schedule import lr_at
from ..runs.sinks import JsonlLog, Progress, TensorBoard
from ..data.tokenizer import load_tokenizer


@dataclass
class StepLosses:
    """Device-side means over one optimizer step's micro-batches."""

    loss: torch.Tensor
    ce: torch.Tensor
    moe: torch.Tensor
    mtp: torch.Tensor | None = None  # model.mtp_depth > 0: the MTP modules' mean loss (layers/mtp.py)


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: bool = False,
                 device: torch.device | None = None,
                 init_weights: Callable[[MoEModel], None] | None = None) -> None:
        """`device` overrides `train.device` (tests run a step on "meta"). `init_weights` fills the
        freshly built model (on the CPU, before it is moved or parallelized), e.g. from a Hugging
        Face checkpoint (`dropless train --init-from hf:DIR`)."""
        self.cfg = cfg
        t = cfg.train
        backend = dist.get_backend() if dist.is_initialized() else None
        self.placement = placement.resolve(device if device is not None else t.device, t.dtype, backend)
        self.device = self.placement.device
        placement.activate(self.device)
        self.run_dir = Path(run_dir)
        if t.threads:
            torch.set_num_threads(t.threads)
        if t.deterministic:
            placement.deterministic(self.device)
        torch.manual_seed(t.seed)
        self.tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_path)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's "
                             f"vocabulary ({self.tokenizer.vocab_size})")
        self.train_tokens, self.val_tokens = load_splits(
            cfg.data.sources or None, self.tokenizer, val_fraction=cfg.data.val_fraction,
            max_bytes=cfg.data.max_bytes or None, text_field=cfg.data.text_field)
        self.distributed = dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.is_main = self.rank == 0
        # buffered EP: the shared bound on a micro-batch's tokens; a replayed record's sequences are as
        # long as model.max_seq_len, not train.seq_len (data/replay.py)
        longest = cfg.model.max_seq_len if cfg.data.replay_routing else t.seq_len
        p = cfg.parallel.with_token_bound(t.batch_size * longest)
        if not self.distributed and p.ep_size > 1:
            raise ValueError(f"parallel.ep_size={p.ep_size}: expert parallelism needs several processes "
                             "(dropless train --nproc N, or torchrun -m dropless.train)")
        # Built on the CPU with the same seed on every rank and device: identical initial weights.
        self.model = MoEModel(cfg.model)
        if init_weights is not None and not resume:
            init_weights(self.model)
        self.model = self.model.to(self.device)
        self.param_counts = self.model.num_params()  # before sharding: global counts
        self.meshes: Meshes | None = None
        self.expert_names: list[str] = []
        reduce = None
        if self.distributed:
            self.meshes = build_meshes(p.ep_size, self.device.type)
            self.expert_names = par.parallelize_model(self.model, self.meshes, p)
            reduce = par.dp_all_reduce(self.meshes.dp_group)
        self.comm_watch = build_watch(self.meshes, self.device, p)  # None in one process
        self.replicas = HotReplicas.build(self.model, self.meshes, p, self.device)  # before the guards
        # train.compile: the blocks compiled in place (names, state and checkpoints unchanged)
        self.compiled = (compiling.compile_blocks(self.model, self.device, self.placement.autocast_dtype)
                         if t.compile else None)
        self.optimizer = build_optimizer(self.model, t, self.placement.autocast_dtype)
        self.overflow = (build_guard(self.model, self.optimizer, reduce, p, cfg.model.moe.top_k, self.device)
                         if self.distributed else None)
        self.nonfinite = NonFiniteGuard(t.max_nonfinite_steps, reduce, device=self.model.embed.weight.device)
        self.start_step = 0
        # routing replay: the record's sequences and expert ids replace the data split's batches
        self.replay = (ReplayData(cfg.data.replay_routing, cfg, self.model.expert_slots(), self.device,
                                  t.grad_accum * self.world_size)
                       if cfg.data.replay_routing else None)
        probe = next(iter(eval_batches(self.val_tokens, min(4, t.batch_size), t.seq_len, 1,
                                       device=self.device)))[0]
        if resume and ckpt.latest_checkpoint(self.run_dir) is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.run_dir / 'checkpoints'}")
        # The first write, after everything a bad config or data path can fail on: a failed start
        # leaves no run directory behind and writes nothing into an existing one.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = JsonlLog(self.run_dir / "metrics.jsonl")
        self.routing = JsonlLog(self.run_dir / "routing.jsonl")
        self.health_log = JsonlLog(self.run_dir / "health.jsonl")
        if resume:
            self._resume()
        elif self.is_main:
            for log in (self.metrics, self.routing, self.health_log):
                log.truncate_from(0)
        self.health = TrainHealth(self.model, self.run_dir, probe, all_reduce=reduce,
                                  echo=cfg.log.progress, write=self.is_main,
                                  alarm_warmup=t.warmup_steps, a2a_alarm_ratio=p.a2a_alarm_ratio,
                                  a2a_watch=self.comm_watch if p.ep_size > 1 else None)
        if resume:
            self.health.restore(self._resume_state.get("health", {}), self.routing.read(),
                                rank=self.rank, world=self.world_size)
        if self.is_main:
            save_config(cfg, self.run_dir / "config.toml")

    # ---------------------------------------------------------------------------------------------

    def _resume(self) -> None:
        """Load the latest checkpoint (written at any world size) after checking that this run's
        config may continue it (resume.py); log the config changes and the world size."""
        path = ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {self.run_dir / 'checkpoints'}")
        saved = dist_checkpoint.trainer_state(path)
        changes = check_resume_config(saved["config"], self.cfg, int(saved["step"]))
        fresh = optimizer_note(changes)  # another optimizer's state is not loaded (resume.py)
        # an imported model's step-0 checkpoint holds no optimizer state (hf/import_hf.py)
        with_state = fresh is None and saved.get("optimizer_state", True)
        state = dist_checkpoint.load(path, self.model, self.optimizer, experts=self.expert_names,
                                     meshes=self.meshes, optimizer_state=with_state)
        ckpt.set_rng_state(state["rng"])
        self.nonfinite.load_state_dict(state.get("nonfinite", {}))
        self.start_step = int(state["step"])
        self._resume_state = state
        note = self.replay.resume(state.get("replay"), self.start_step) if self.replay is not None else None
        if note and self.is_main:
            print(note, flush=True)
        if self.is_main:
            for log in (self.metrics, self.routing, self.health_log):
                log.truncate_from(self.start_step)
            report_resume(path, state, self.world_size, changes, self.metrics, [fresh] if fresh else [])
        if self.distributed:
            dist.barrier()  # the logs are cut before any rank reads them

    def save(self, next_step: int) -> Path:
        """Checkpoint `next_step` in the one format every world size reads (dist_checkpoint.py);
        collective under several processes."""
        state = {"step": next_step, "rng": ckpt.rng_state(), "config": to_dict(self.cfg),
                 "world_size": self.world_size, "nonfinite": self.nonfinite.state_dict(),
                 "health": dist_checkpoint.gather_health(self.health.state_dict(), self.distributed)}
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return dist_checkpoint.save(self.run_dir, next_step, self.model, self.optimizer, state,
                                    experts=self.expert_names, meshes=self.meshes,
                                    keep_last=self.cfg.train.keep_last)

    def micro_index(self, micro: int) -> int:
        """This rank's micro-batch `micro` is the one-process micro-batch micro * W + rank."""
        return micro * self.world_size + self.rank

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """(inputs, targets, replayed ids per MoE layer or None) of this rank's micro-batch."""
        if self.replay is not None:
            return self.replay.batch(step, self.micro_index(micro))
        t = self.cfg.train
        x, y = get_batch(self.train_tokens, step, self.micro_index(micro), t.batch_size, t.seq_len,
                         t.seed, device=self.device)
        return x, y, None

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.placement.autocast()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy over the validation batches. With W processes each rank evaluates every
        W-th batch and the sums are all-reduced: the mean of one process (up to the order of the
        additions) in 1/W of the time. Every rank must run the same number of forwards (FSDP
        gathers, EP all-to-alls), so a rank without a batch in the last round reruns one and
        discards it; EP layers dispatch in exact mode meanwhile (ranks may then hold batches of
        different sizes; exact mode never drops a pair)."""
        t = self.cfg.train
        self.model.eval()
        batches = list(eval_batches(self.val_tokens, t.batch_size, t.seq_len, t.eval_batches,
                                    device=self.device))
        mine = batches[self.rank::self.world_size]
        rounds = -(-len(batches) // self.world_size)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # sum of ce * tokens, tokens
        with par.exact_dispatch(self.model):
            for i in range(rounds):
                x, y = mine[i] if i < len(mine) else batches[0]
                with self.autocast():
                    out = self.model(x, y)
                if i < len(mine):  # on the device: one host read after the loop, not one per batch
                    sums[0] += out.ce_loss.detach().double() * x.numel()
                    sums[1] += x.numel()
        if self.distributed:
            self.health.reduce(sums, "sum")
        self.model.train()
        total, n = sums.tolist()
        return total / max(n, 1)

    def _global_counts(self, step: int) -> torch.Tensor | None:
        """Counts of the whole step (all micro-batches, all ranks) before any backward, for the
        global-batch aux loss. With one micro-batch they come from the forward itself (None here);
        with several, a no-grad forward pre-pass computes them: one extra forward per step, the price
        of an exact global loss under accumulation (layers/balance.py)."""
        t = self.cfg.train
        if self.cfg.model.moe.balance.global_aux_loss_coeff == 0 or t.grad_accum == 1:
            return None
        L, E = len(self.model.moe_layers()), self.model.expert_slots().selectable  # identity experts too
        counts = torch.zeros(L, E, device=self.device)
        with torch.no_grad():
            for micro in range(t.grad_accum):
                x, _, ids = self.batch(step, micro)
                with self.autocast():
                    out = self.model(x, replay_ids=ids)
                counts += torch.stack([s.tokens_per_expert_E.float() for s in out.stats])
        self.health.reduce(counts, "sum")
        return counts

    def train_step(self, step: int, log_step: bool = False) -> tuple[StepLosses, torch.Tensor]:
        t = self.cfg.train
        lr = lr_at(step, base_lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, kind=t.schedule,
                   min_lr_ratio=t.min_lr_ratio, decay_fraction=t.decay_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        guard = self.overflow
        retry = guard is not None and self.cfg.parallel.overflow_policy == "retry"
        snap = self.health.snapshot() if retry else None
        sums, dropped, demand = self._forward_backward(step, log_step)
        invalid = None
        if guard is not None:
            dropped, demand = guard.reduce_step(dropped, demand)
            if not retry:
                invalid = guard.note(dropped, demand)
            elif bool(dropped > 0):  # the one host read per step that retry costs (overflow.py)
                self.optimizer.zero_grad(set_to_none=True)
                self.health.rollback(snap, log_step)
                guard.retried += 1
                with par.worst_case_dispatch(self.model):
                    sums, _, _ = self._forward_backward(step, log_step)
                guard.after_retry(step)
        if self.distributed:
            grad_norm = par.finish_grads_(self.model, self.expert_names, self.meshes.mesh.size(1),
                                          t.grad_clip, self.meshes.dp_group)
        elif t.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        # a step with a non-finite loss or gradient norm, or an unhandled EP overflow, is skipped on the
        # device: optimizer and router buffers unchanged (nonfinite.py)
        bad = self.nonfinite.flag(sums.loss, grad_norm)
        skip = bad if invalid is None else bad | invalid
        step_unless(self.optimizer, skip)
        self.optimizer.zero_grad(set_to_none=True)
        self.health.end_step(skip, nonfinite=bad, rate_scale=balance.bias_rate_scale(
            self.cfg.model.moe.balance.bias_rate_schedule, step, lr, t.lr, t.warmup_steps))
        return sums, grad_norm

    def _forward_backward(self, step: int, log_step: bool) -> tuple[StepLosses, torch.Tensor, torch.Tensor]:
        """The step's micro-batches, forward and backward; returns the mean losses and this rank's
        EP overflow (dropped pairs, busiest link demand), device scalars."""
        t = self.cfg.train
        bal, K = self.cfg.model.moe.balance, self.cfg.model.moe.top_k
        pre_counts = self._global_counts(step)
        self.health.begin_step(log_step, step)
        zero = lambda dtype=torch.float32: torch.zeros((), dtype=dtype, device=self.device)  # noqa: E731
        sums = StepLosses(zero(), zero(), zero(), zero() if self.cfg.model.mtp_depth else None)
        dropped, demand = zero(torch.int64), zero(torch.int64)
        for micro in range(t.grad_accum):
            x, y, ids = self.batch(step, micro)
            with self.autocast():
                out = self.model(x, y, replay_ids=ids)
            loss, moe_loss = out.loss, out.moe_loss
            if bal.global_aux_loss_coeff > 0 and out.moe:
                counts = pre_counts
                if counts is None:
                    counts = torch.stack([s.tokens_per_expert_E.float() for s in out.stats])
                    self.health.reduce(counts, "sum")
                extra = bal.global_aux_loss_coeff * global_aux_terms(
                    out, counts, K, num_tokens=x.numel(), num_terms=t.grad_accum * self.world_size)
                loss, moe_loss = loss + extra, moe_loss + extra
            (loss / t.grad_accum).backward()
            self.health.add_micro(out)
            if self.replicas is not None:
                self.replicas.observe(out.stats)
            if self.overflow is not None:
                self.overflow.observe(out.stats)
                d, m = OverflowGuard.count(out.stats)
                dropped, demand = dropped + d, torch.maximum(demand, m)
            sums.loss += loss.detach().float() / t.grad_accum
            sums.ce += out.ce_loss.detach().float() / t.grad_accum
            sums.moe += moe_loss.detach().float() / t.grad_accum
            if sums.mtp is not None:
                sums.mtp += out.mtp_loss.detach().float() / t.grad_accum
        return sums, dropped, demand

    def log_row(self, step: int, sums: StepLosses, grad_norm: torch.Tensor, tokens_per_s: float) -> dict:
        # The one host sync of the interval for the losses; the routing record makes its own.
        mtp = [sums.mtp] if sums.mtp is not None else []
        losses = torch.stack([sums.loss, sums.ce, sums.moe, *mtp])
        if self.distributed:  # means over ranks (the gradient norm is already global)
            self.health.reduce(losses, "sum")
            losses = losses / self.world_size
        values = torch.cat([grad_norm.float().reshape(1), losses]).tolist()
        row = {"step": step, "loss": values[1], "ce_loss": values[2], "moe_loss": values[3],
               "grad_norm": values[0], "lr": self.optimizer.param_groups[0]["lr"],
               "tokens_per_s": tokens_per_s}
        if sums.mtp is not None:  # logged apart: ce_loss stays the main prediction's alone
            row["mtp_loss"] = values[4]
        with par.worst_case_dispatch(self.model):  # the probe must not depend on the buffer size
            record = self.health.record(step, self.autocast(), self.run_dir)
        if record:
            row["maxvio_global"] = max(layer["maxvio_global"] for layer in record["layers"])
            row["maxvio_local"] = max(layer["maxvio_local"] for layer in record["layers"])
            row["pairs_dropped"] = sum(layer["dropped"] for layer in record["layers"])
        return row

    def fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        tb = TensorBoard(self.run_dir / "tensorboard", cfg.log.tensorboard and self.is_main)
        bar = Progress(t.steps, self.start_step, cfg.log.progress and self.is_main)
        seq_tokens = self.replay.tokens_per_sequence() if self.replay is not None else t.seq_len
        tokens_per_step = t.batch_size * seq_tokens * t.grad_accum * self.world_size
        params = self.param_counts
        say = bar.write if self.is_main else (lambda text: None)
        if self.is_main:
            print(self.placement.describe(), flush=True)
            self.metrics.write({"step": self.start_step, **self.placement.as_dict()})
            if self.replay is not None:
                say(self.replay.describe())
        say(f"model: {params['total'] / 1e6:.2f}M parameters, {params['active'] / 1e6:.2f}M active; "
                  f"train {self.train_tokens.numel() / 1e6:.1f}M tokens, val {self.val_tokens.numel() / 1e6:.2f}M")
        last_time, last_step = time.perf_counter(), self.start_step
        row: dict[str, Any] = {}
        val_loss = math.nan
        start_wall = time.perf_counter()
        try:
            for step in range(self.start_step, t.steps):
                last = step + 1 == t.steps
                log_step = (step + 1) % cfg.log.log_every == 0 or last or step == 0
                with watch_step(self.comm_watch, step, check=log_step):  # distributed/watch.py
                    stats, grad_norm = self.train_step(step, log_step)
                if log_step:
                    now = time.perf_counter()
                    n_steps = step + 1 - last_step
                    tps = tokens_per_step * n_steps / max(now - last_time, 1e-9)
                    step_ms = 1e3 * (now - last_time) / n_steps
                    last_time, last_step = now, step + 1
                    row = self.log_row(step, stats, grad_norm, tps)
                    row["step_ms"] = step_ms
                    self.nonfinite.read()
                    row["nonfinite_steps"] = self.nonfinite.take()  # skipped since the last row
                    if self.is_main:
                        self.metrics.write(row)
                    self.nonfinite.stop_if_stuck(step)
                    tb.scalars(step, row)
                    fields = {"loss": f"{row['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
                    if "maxvio_global" in row:
                        fields["maxvio"] = f"{row['maxvio_global']:.2f}"
                    bar.update(step + 1, fields)
                if (step + 1) % t.eval_every == 0 or last:
                    val_loss = self.evaluate()
                    if self.is_main:
                        self.metrics.write({"step": step, "val_loss": val_loss})
                    tb.scalars(step, {"val_loss": val_loss})
                    say(f"step {step + 1}: val_loss {val_loss:.4f} nats/token")
                place = self.replicas.maybe_place(step) if self.replicas is not None else None
                if place is not None and self.is_main:
                    self.metrics.write(place)
                save = (step + 1) % t.ckpt_every == 0 or last
                if self.overflow is not None and (save or (step + 1) % self.overflow.check_every == 0):
                    ep_row = self.overflow.check(step)  # before a checkpoint: none covers a skipped step unseen
                    if self.is_main:
                        self.metrics.write(ep_row)
                if save:
                    self.nonfinite.read()
                    self.nonfinite.stop_if_stuck(step)  # a run that keeps failing writes no more
                    self.save(step + 1)
        finally:
            bar.close()
            tb.close()
        return self.finish(val_loss, time.perf_counter() - start_wall)

    def finish(self, val_loss: float, wall_s: float) -> dict[str, Any]:
        if not self.is_main:
            return {"steps": self.cfg.train.steps, "final_val_loss": val_loss, "rank": self.rank}
        rows = self.metrics.read()
        train_rows = [r for r in rows if "loss" in r]
        params = self.param_counts
        summary = {
            "steps": self.cfg.train.steps,
            "final_val_loss": val_loss,
            "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
            "tokens_per_s": (sum(r["tokens_per_s"] for r in train_rows[-10:]) / len(train_rows[-10:])
                             if train_rows else None),
            "params_total": params["total"],
            "params_active": params["active"],
            "nonfinite_steps": sum(r.get("nonfinite_steps", 0) for r in train_rows),  # resumes included
            **self.placement.as_dict(),
            "wall_s_this_process": wall_s,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.cfg.log.plots:
            from .plots import write_run_plots

            written = write_run_plots(self.run_dir)
            summary["plots"] = [str(p) for p in written]
        return summary
