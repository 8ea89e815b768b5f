"""The training loop: one process or many, gradient accumulation, autocast, evaluation, checkpoints.

A `Trainer` is composed of parts, each built by a named factory in its own module, in this order:

    layout        layout.py       device and dtype, seed, processes; the model placed and parallelised
    data          data_source.py  tokenizer, train/val splits, routing replay; this rank's micro-batches
    compiled      compiling.py    train.compile: the blocks compiled in place
    optimizer     optim.py        AdamW, AdamW with bf16 state, or Muon
    step_fns      compile_step.py the gradient norm and the update (train.compile=step: compiled, and
                                  the whole model with them)
    overflow      overflow.py     buffered EP's overflow policy (skip, check, retry); None otherwise
    nonfinite     nonfinite.py    skips a step whose loss or gradient norm is not finite
    health        health.py       routing statistics, balancing rules, alarms
    run_dir       run_dir.py      logs, checkpoints and resume, sinks, summary, plots
    micro         micro_batches.py  a step's forward and backward passes and their losses

Per optimizer step (`train_step`): the learning rate from the schedule; `grad_accum` micro-batches
forward and backward (micro_batches.py; under buffered EP the overflow policy may rerun them with
worst-case buffers); the gradient norm over the layout, clipped; the optimizer step, skipped on the
device when the step is flagged (non-finite, or an unhandled EP overflow); the balancing rules.
The MoE layers' statistics stay on the device and are summed over the step; the host reads them
(one sync) every `log.log_every` steps, together with the loss. After `train.max_nonfinite_steps`
flagged steps in a row the run stops (nonfinite.py).

Distributed (a process group is initialised, e.g. by torchrun): rank r's micro-batch m of step s is
the micro-batch (m * W + r) that one process with W times the accumulation would draw
(data_source.py; tests/distributed/test_parallel_train.py). Health counts are all-reduced over the
ranks; the logged losses are means over ranks; only rank 0 writes files and progress.

Device and dtype (`train.device`, `train.dtype`; decided once in device.py and logged with the
reason): the optimizer state, batches, statistics and every tensor of a step are made on the device.
The host reads the device only on log steps, at evaluation and at checks.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig, save_config, to_dict
from ..data.windows import IGNORE_INDEX
from ..distributed import parallelize as par
from ..distributed.materialize import Fill
from ..distributed.watch import watch_step
from ..layers import balance
from ..runs import checkpoint as ckpt
from ..hf.load_run import base_fill
from ..runs import dist_checkpoint, lora_base
from . import compiling
from .data_source import load_data, with_replay
from .health import build_health
from .layout import build_layout, place_model
from .micro_batches import StepLosses, build_micro_batches
from .pipeline_micro import PipelineMicroBatches
from .nonfinite import NonFiniteGuard
from .compile_step import build_step_fns, check_cuda_graphs
from .optim import build_optimizer
from .overflow import build_guard
from .run_dir import Sinks, open_run_dir
from .schedule import lr_at


class Trainer:
    """A training run: the parts of the module note; `fit` trains to `train.steps`, `train_step` runs
    one optimizer step."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: bool = False,
                 device: torch.device | None = None,
                 init_weights: Fill | None = None) -> None:
        """`device` overrides `train.device` (tests run a step on "meta"). `init_weights` fills each
        rank's shards of the freshly materialised model instead of the initial weights
        (distributed/materialize.py), e.g. from a Hugging Face checkpoint (`dropless train
        --init-from hf:DIR`)."""
        self.cfg = cfg
        t = cfg.train
        self.layout = build_layout(cfg, device)
        self.data = load_data(cfg, self.layout)
        fill = None if resume else init_weights
        self.lora_base: str | None = None
        if t.lora.enabled:  # the frozen base, at every start (runs/lora_base.py); its digest for checkpoints
            fill = base_fill(t.lora, progress=cfg.log.progress)
            self.lora_base = lora_base.base_digest(t.lora, t.seed, progress=cfg.log.progress)
            latest = ckpt.latest_checkpoint(run_dir) if resume else None
            if latest is not None:
                lora_base.check_digest(dist_checkpoint.trainer_state(latest).get("lora_base"), self.lora_base,
                                       f"--resume from {latest}")
        # pipeline stages pass packed windows' document ids on with the hidden states (a batch is a
        # function of (seed, step, micro-step): drawing one here changes nothing)
        packed = cfg.parallel.pp_size > 1 and self.data.batch(0, 0).segments_BS is not None
        self.layout, self.model = place_model(cfg, self.layout, fill, packed=packed)
        lay = self.layout
        check_cuda_graphs(t, lay.device)  # before anything is written
        if t.compile == "step" and lay.distributed and cfg.parallel.fsdp:  # (the EP settings: config.py)
            raise ValueError(f"train.compile='step' with {lay.world_size} processes and parallel.fsdp=true: "
                             "FSDP2's hooks cannot be traced; set parallel.fsdp=false (the replicated "
                             "layout, distributed/replicated.py), or use train.compile=blocks")
        # train.compile: the blocks, or the whole model, compiled in place (names, state and
        # checkpoints unchanged); under "step" also the gradient norm and the update (compile_step.py)
        # (several processes: evaluation dispatches in exact mode, whose split sizes are host reads a
        # fullgraph block cannot hold, so calls without autograd run eager, as under "step")
        self.compiled = (compiling.compile_blocks(self.model, lay.device, t.compile_backend,
                                                  train_only=lay.distributed)
                         if t.compile == "blocks" else None)
        self.optimizer = build_optimizer(self.model, t, lay.placement.autocast_dtype)
        self.step_fns = build_step_fns(t, lay, self.model, self.optimizer)
        if self.step_fns.model_graph is not None:
            self.compiled = self.step_fns.model_graph
        self.overflow = (build_guard(self.model, self.optimizer, lay.reduce, lay.parallel, cfg.model.moe.top_k,
                                     lay.device) if lay.distributed else None)
        self.nonfinite = NonFiniteGuard(t.max_nonfinite_steps, lay.reduce, device=lay.device)
        self.data = with_replay(self.data, cfg, self.model)
        self.health = build_health(cfg, self.model, lay, self.data.probe(), Path(run_dir))
        self.run_dir = open_run_dir(run_dir, resume, lay.is_main)  # the first write
        self.start_step = 0
        if resume:
            state = self.run_dir.resume(cfg, lay, self.model, self.optimizer, self.nonfinite, self.data.replay)
            self.start_step = int(state["step"])
            health = state.get("health", {})
            pp_then = state.get("pp_size", 1)
            if pp_then > 1 or cfg.parallel.pp_size > 1:
                # trainer.pt holds rank 0's probe ids, which under stages are rank 0's layers only: the
                # first flip rate after the resume is left out; the interval's per-rank sums are kept
                # where every rank holds the same layers as before (same layout), else they restart
                same = pp_then == cfg.parallel.pp_size and state.get("world_size") == lay.world_size
                health = {k: v for k, v in health.items() if k != "prev_probe_ids" and (same or k != "acc")}
            self.health.restore(health, self.run_dir.routing.read(), rank=lay.rank, world=lay.world_size)
        self.micro = (build_micro_batches(cfg, self.model, self.data, lay, self.health, self.overflow)
                      if lay.pipeline is None else
                      PipelineMicroBatches(lay.pipeline, t.grad_accum, self.data, self.health, lay.placement.autocast,
                                           lay.device))
        if lay.is_main:
            save_config(cfg, self.run_dir.path / "config.toml")

    def save(self, next_step: int) -> Path:
        """Checkpoint `next_step` in the one format every world size reads (dist_checkpoint.py);
        collective under several processes."""
        lay = self.layout
        state = {"step": next_step, "rng": ckpt.rng_state(), "config": to_dict(self.cfg),
                 "world_size": lay.world_size, "pp_size": self.cfg.parallel.pp_size,
                 "nonfinite": self.nonfinite.state_dict(),
                 "health": dist_checkpoint.gather_health(self.health.state_dict(), lay.distributed)}
        if self.data.replay is not None:
            state["replay"] = self.data.replay.state_dict()
        if self.lora_base is not None:
            state["lora_base"] = self.lora_base
        return dist_checkpoint.save(self.run_dir.path, next_step, self.model, self.optimizer, state,
                                    experts=lay.expert_names, meshes=lay.meshes, keep_last=self.cfg.train.keep_last)

    # -- one optimizer step ----------------------------------------------------------------------------

    def train_step(self, step: int, log_step: bool = False) -> tuple[StepLosses, torch.Tensor]:
        t = self.cfg.train
        lr = lr_at(step, base_lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, kind=t.schedule,
                   min_lr_ratio=t.min_lr_ratio, decay_fraction=t.decay_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums, invalid = self._gradients(step, log_step)
        grad_norm = self.step_fns.grad_norm()  # clipped to train.grad_clip (layout.finish_grads)
        # a step with a non-finite loss or gradient norm, or an unhandled EP overflow, is skipped on the
        # device: optimizer and router buffers unchanged (nonfinite.py)
        bad = self.nonfinite.flag(sums.loss, grad_norm)
        skip = bad if invalid is None else bad | invalid
        self.step_fns.update(skip)  # optim.step_unless
        self.optimizer.zero_grad(set_to_none=True)
        self.health.end_step(skip, nonfinite=bad, rate_scale=balance.bias_rate_scale(
            self.cfg.model.moe.balance.bias_rate_schedule, step, lr, t.lr, t.warmup_steps))
        return sums, grad_norm

    def _gradients(self, step: int, log_step: bool) -> tuple[StepLosses, torch.Tensor | None]:
        """The step's forward and backward passes, with buffered EP's overflow policy: the device flag
        of a step to skip (skip, check; None otherwise), or an overflowing step's passes rerun with
        worst-case buffers (retry)."""
        guard = self.overflow
        retry = guard is not None and self.cfg.parallel.overflow_policy == "retry"
        snap = self.health.snapshot() if retry else None
        sums, dropped, demand = self.micro.run(step, log_step)
        if guard is None:
            return sums, None
        dropped, demand = guard.reduce_step(dropped, demand)
        if not retry:
            return sums, guard.note(dropped, demand)
        if bool(dropped > 0):  # the one host read per step that retry costs (overflow.py)
            self.optimizer.zero_grad(set_to_none=True)
            self.health.rollback(snap, log_step)
            guard.retried += 1
            with par.worst_case_dispatch(self.model):
                sums, _, _ = self.micro.run(step, log_step)
            guard.after_retry(step)
        return sums, None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean cross-entropy over the validation batches. With W processes each rank evaluates every
        W-th batch and the sums are all-reduced: the mean of one process (up to the order of the
        additions) in 1/W of the time. Every rank must run the same number of forwards (FSDP
        gathers, EP all-to-alls), so a rank without a batch in the last round reruns one and
        discards it; EP layers dispatch in exact mode meanwhile (ranks may then hold batches of
        different sizes; exact mode never drops a pair)."""
        lay = self.layout
        self.model.eval()
        batches = self.data.val_batches()
        mine = batches[lay.dp_rank::lay.dp_world]  # (every rank of a pipeline: the same batches)
        rounds = -(-len(batches) // lay.dp_world)
        sums = torch.zeros(2, dtype=torch.float64, device=lay.device)  # sum of ce * tokens, tokens
        with par.exact_dispatch(self.model):
            for i in range(rounds):
                w = mine[i] if i < len(mine) else batches[0]
                with lay.placement.autocast():
                    out = self.model(w.x_BS, w.y_BS, segments_BS=w.segments_BS)
                if i < len(mine):  # on the device: one host read after the loop, not one per batch
                    n = (w.y_BS != IGNORE_INDEX).sum().double()  # targets that take loss
                    sums[0] += out.ce_loss.detach().double() * n
                    sums[1] += n
        if lay.distributed:
            self.health.reduce(sums, "sum")
        self.model.train()
        total, n = sums.tolist()
        return total / max(n, 1)

    def log_row(self, step: int, sums: StepLosses, grad_norm: torch.Tensor, tokens_per_s: float) -> dict:
        # The one host sync of the interval for the losses; the routing record makes its own.
        mtp = [sums.mtp] if sums.mtp is not None else []
        losses = torch.stack([sums.loss, sums.ce, sums.moe, *mtp])
        if self.layout.pipeline is not None:  # each rank holds its stages' part: summed over all ranks
            torch.distributed.all_reduce(losses)
            losses = losses / self.layout.dp_world
        elif self.layout.distributed:  # means over ranks (the gradient norm is already global)
            self.health.reduce(losses, "sum")
            losses = losses / self.layout.world_size
        values = torch.cat([grad_norm.float().reshape(1), losses]).tolist()
        row = {"step": step, "loss": values[1], "ce_loss": values[2], "moe_loss": values[3],
               "grad_norm": values[0], "lr": self.optimizer.param_groups[0]["lr"],
               "tokens_per_s": tokens_per_s}
        if sums.mtp is not None:  # logged apart: ce_loss stays the main prediction's alone
            row["mtp_loss"] = values[4]
        with par.worst_case_dispatch(self.model):  # the probe must not depend on the buffer size
            record = self.health.record(step, self.layout.placement.autocast(), self.run_dir.path)
        if record:
            row["maxvio_global"] = max(layer["maxvio_global"] for layer in record["layers"])
            row["maxvio_local"] = max(layer["maxvio_local"] for layer in record["layers"])
            row["pairs_dropped"] = sum(layer["dropped"] for layer in record["layers"])
        return row

    # -- the run ---------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        sinks = self.run_dir.open_sinks(cfg, self.start_step, self.data.tokens_per_step())
        self._announce(sinks)
        val_loss = math.nan
        start_wall = sinks.last_time = time.perf_counter()
        try:
            for step in range(self.start_step, t.steps):
                last = step + 1 == t.steps
                log_step = (step + 1) % cfg.log.log_every == 0 or last or step == 0
                with watch_step(self.layout.comm_watch, step, check=log_step):  # distributed/watch.py
                    stats, grad_norm = self.train_step(step, log_step)
                if log_step:
                    self._log(step, stats, grad_norm, sinks)
                if (step + 1) % t.eval_every == 0 or last:
                    val_loss = self._validate(step, sinks)
                place = self.layout.replicas.maybe_place(step) if self.layout.replicas is not None else None
                if place is not None:
                    self.run_dir.write(place)
                save = (step + 1) % t.ckpt_every == 0 or last
                if self.overflow is not None and (save or (step + 1) % self.overflow.check_every == 0):
                    # before a checkpoint: none covers a skipped step unseen
                    self.run_dir.write(self.overflow.check(step))
                if save:
                    self.nonfinite.read()
                    self.nonfinite.stop_if_stuck(step)  # a run that keeps failing writes no more
                    self.save(step + 1)
        finally:
            sinks.close()
        return self.run_dir.finish(cfg, self.layout, val_loss, time.perf_counter() - start_wall)

    def _announce(self, sinks: Sinks) -> None:
        """The placement (printed and logged), the replayed record, the model's size and the data's."""
        lay, params = self.layout, self.layout.param_counts
        if lay.is_main:
            print(lay.placement.describe(), flush=True)
            self.run_dir.write({"step": self.start_step, **lay.placement.as_dict()})
            if self.data.replay is not None:
                sinks.say(self.data.replay.describe())
        sinks.say(f"model: {params['total'] / 1e6:.2f}M parameters, {params['active'] / 1e6:.2f}M active; "
                  f"{self.data.describe()}")

    def _log(self, step: int, stats: StepLosses, grad_norm: torch.Tensor, sinks: Sinks) -> None:
        """A log step's row: losses, routing health, throughput and the steps skipped since the last."""
        n_steps = step + 1 - sinks.last_step
        tps, step_ms = sinks.throughput(step)
        row = self.log_row(step, stats, grad_norm, tps)
        row["step_ms"] = step_ms
        row["data_ms"] = self.micro.take_data_ms(n_steps)  # drawing the batches, part of step_ms
        self.nonfinite.read()
        row["nonfinite_steps"] = self.nonfinite.take()  # skipped since the last row
        self.run_dir.write(row)
        self.nonfinite.stop_if_stuck(step)
        sinks.show(step, row)

    def _validate(self, step: int, sinks: Sinks) -> float:
        val_loss = self.evaluate()
        self.run_dir.write({"step": step, "val_loss": val_loss})
        sinks.tb.scalars(step, {"val_loss": val_loss})
        sinks.say(f"step {step + 1}: val_loss {val_loss:.4f} nats/token")
        return val_loss
