"""Routing health and balancing rules, as the trainer runs them.

Per micro-batch the MoE layers' statistics (device tensors) go into a `StepAccumulator`. Per
optimizer step the step's counts are summed over data-parallel ranks and feed the balancing rules
that move router buffers (loss-free bias, quantile balancing, expert-threshold EMA): once per
optimizer step, outside the forward pass, so gradient accumulation or recompute never count a step
twice. Per log interval: one host sync for the whole record, probe-batch flip rates, the alarms;
under EP also the interval's all-to-all time per step (distributed/watch.py), for its alarm.

A skipped step changes nothing. The trainer skips a step on the device (a non-finite loss or
gradient norm, train/nonfinite.py; buffered EP overflow without retry, overflow.py) and passes the
flag to `end_step(skip)`: every buffer rule then writes `where(skip, old, new)`, so the expert bias
and the thresholds keep their values bit for bit, without a host read; the step's statistics leave
the routing record (monitor/stats.py StepAccumulator, which counts the skipped steps instead).

The MTP modules' MoE blocks (model.mtp_block "moe") are balanced with the main layers: their step
counts, quantiles and thresholds feed the same buffer rules (`rule_layers`: the main layers, then
theirs). Their statistics stay out of the routing record and the alarms, which are the main
model's layers (`model.moe_layers()`), and the probe never runs them (evaluation mode).

The probe batch is fixed for the run (the first validation window), so the step-to-step flip rate
measures the router changing, not the data.

Distributed: `all_reduce` is a real reduction over the data-parallel group (sum or max, in place), so
counts, the balancing rules and the record span all ranks; every rank runs `record` (the probe is a
forward through the sharded model, which needs every rank), only the one built with `write=True`
writes files and prints.
"""

from __future__ import annotations

import json
from pathlib import Path
import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch.distributed.fsdp import FSDPModule

from ..config import RunConfig
from ..distributed.pipeline_model import merge_records
from ..layers import balance
from ..layers.moe import MoELayer
from ..model import MoEModel, ModelOutput
from ..monitor import stats as mstats
from ..monitor.alarms import AlarmThresholds, HealthMonitor
from .layout import AllReduce, Layout

if TYPE_CHECKING:
    from ..distributed.watch import CommWatch


def _no_reduce(t: torch.Tensor, op: str) -> None:
    return None


class TrainHealth:
    def __init__(self, model: MoEModel, run_dir: Path, probe_BS: torch.Tensor,
                 all_reduce: AllReduce | None = None, echo: bool = True, write: bool = True,
                 alarm_warmup: int = 0, a2a_watch: "CommWatch | None" = None,
                 a2a_alarm_ratio: float = 1.5, merge: Callable[[dict], dict] | None = None) -> None:
        """`merge`: under pipeline stages, gathers the ranks' records of their own layers into the
        whole model's (distributed/pipeline_model.py); every rank calls it."""
        self.model = model
        self.merge = merge
        self.layers: list[MoELayer] = model.moe_layers()
        moe = model.cfg.moe
        self.cfg = moe
        # per-expert tables over every selectable expert: the layers count identity experts too
        self.slots = model.expert_slots()
        self.reduce = all_reduce or _no_reduce
        dev = next(model.parameters()).device  # (a pipeline stage may hold no embedding)
        self.acc = mstats.StepAccumulator(len(self.layers), self.slots.selectable, moe.top_k, dev)
        # the buffer rules' layers (module note): the main ones, then the MTP modules' MoE blocks
        self.rule_layers: list[MoELayer] = model.all_moe_layers()
        self.mtp_counts_LE = torch.zeros(len(self.rule_layers) - len(self.layers), self.slots.selectable,
                                         device=dev)
        self.write = write
        self.monitor = HealthMonitor(run_dir if write else None, echo=echo and write,
                                     thresholds=AlarmThresholds(warmup_steps=alarm_warmup,
                                                                a2a_slow_ratio=a2a_alarm_ratio))
        self.a2a_watch = a2a_watch  # EP runs: the step's all-to-all time joins the record
        self.probe_BS = probe_BS
        self.prev_probe_ids: list[torch.Tensor | None] = [None] * len(self.layers)
        self._quantile: list[torch.Tensor] = []
        self._step, self._warm = 0, False
        self._threshold: list[torch.Tensor] = []
        self._n_micro = 0

    # -- resume ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's resumable state: the probe ids of the last log step and the routing
        accumulator's running sums (a checkpoint between log steps holds part of an interval)."""
        return {"prev_probe_ids": [p for p in self.prev_probe_ids], "acc": self.acc.state_dict()}

    def restore(self, state: dict, routing_rows: list[dict], rank: int = 0, world: int = 1) -> None:
        """Continue as if never stopped: the probe ids of the last log step and the accumulator's sums
        come from the checkpoint (`state["acc"]` is the list of every saved rank's sums, resharded by
        `StepAccumulator.state_for_rank` when the world size changed; checkpoints from before the sums
        were saved have none); the alarm rules' memory (streaks, what was already reported) is rebuilt
        by replaying the routing rows written before the checkpoint, without printing or writing them
        again."""
        self.prev_probe_ids = [None if p is None else p.to(self.acc.device)
                               for p in state.get("prev_probe_ids", self.prev_probe_ids)]
        acc = state.get("acc")
        if acc is not None and self.layers:
            saved = acc if isinstance(acc, list) else [acc]
            self.acc.load_state_dict(self.acc.state_for_rank(saved, rank, world))
        run_dir, echo = self.monitor.run_dir, self.monitor.echo
        self.monitor.run_dir, self.monitor.echo = None, False
        for row in routing_rows:
            self.monitor.check(row)
        self.monitor.run_dir, self.monitor.echo = run_dir, echo

    # -- per step -----------------------------------------------------------------------------------

    def begin_step(self, log_step: bool, step: int) -> None:
        """`step`: the optimizer step about to run (the loss-free bias's warm start counts them)."""
        bal = self.cfg.balance
        self._step = step
        self._warm = step < bal.bias_warm_start_steps  # the quantile rule sets the bias this step
        for layer in self.layers:
            layer.detailed_stats = log_step
        for layer in self.rule_layers:
            layer.quantile_stats = bal.quantile_balance or self._warm
        self._quantile, self._threshold, self._n_micro = [], [], 0
        self.mtp_counts_LE.zero_()
        if self.layers:
            self.acc.begin_step()

    def add_micro(self, out: ModelOutput) -> None:
        if not self.rule_layers:  # a dense model (the `dense` baseline): nothing to watch
            return
        for i, m in enumerate(out.moe):
            self.acc.add(i, m.stats, m.aux_loss)
        for i, m in enumerate(out.mtp_moe):
            self.mtp_counts_LE[i] += m.stats.tokens_per_expert_E.detach().float()
        rule = [*out.moe, *out.mtp_moe]  # rule_layers' order
        if self.cfg.balance.quantile_balance or self._warm:
            q = torch.stack([m.stats.quantile_bias_E for m in rule])
            self._quantile.append(q)
        if self.cfg.router.strategy == "expert_threshold":
            self._threshold.append(torch.stack([m.stats.score_quantile_E for m in rule]))
        self._n_micro += 1

    def _mean_over_micro_and_ranks(self, items: list[torch.Tensor]) -> torch.Tensor:
        total = torch.stack(items).sum(0)
        n = torch.tensor(float(len(items)), device=total.device)
        self.reduce(total, "sum")
        self.reduce(n, "sum")
        return total / n

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the accumulator, to forget a step that is run again (EP overflow retry)."""
        tensors = {n: t for n, (t, _) in self.acc.interval_tensors().items()}
        tensors["step_counts_LE"] = self.acc.step_counts_LE
        return {n: t.clone() for n, t in tensors.items()}

    def rollback(self, snap: dict[str, torch.Tensor], log_step: bool) -> None:
        for n, t in snap.items():
            getattr(self.acc, n).copy_(t)
        self.begin_step(log_step, self._step)

    @torch.no_grad()
    def end_step(self, skip: torch.Tensor | None = None, nonfinite: torch.Tensor | None = None,
                 rate_scale: float = 1.0) -> None:
        """After the optimizer step: reduce counts over ranks, apply the buffer rules, close the step.
        `skip` (device bool): the step was not applied, so no buffer moves (module note);
        `nonfinite` (device bool): it was skipped for a non-finite loss or gradient norm;
        `rate_scale`: the factor on the loss-free bias step this step (balance.bias_rate_scale)."""
        if not self.rule_layers:
            return
        self.reduce(self.acc.step_counts_LE, "sum")
        if len(self.mtp_counts_LE):
            self.reduce(self.mtp_counts_LE, "sum")
        counts_LE = torch.cat([self.acc.step_counts_LE, self.mtp_counts_LE])  # rule_layers' order

        def keep(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            return new if skip is None else torch.where(skip, old, new)

        bal = self.cfg.balance
        if bal.bias_update_rate > 0 and not self._warm:
            rate = bal.bias_update_rate * rate_scale
            for i, layer in enumerate(self.rule_layers):
                r = layer.router
                bias = r.expert_bias
                if bal.bias_update_rule == "adaptive":
                    new, step, sign = balance.adaptive_bias_update(
                        bias, r.bias_step_E, r.bias_sign_E, counts_LE[i], rate)
                    r.set_adaptive(keep(r.bias_step_E, step), keep(r.bias_sign_E, sign))
                else:
                    new = balance.bias_update(bias, counts_LE[i], rate, bal.bias_update_rule)
                r.set_bias(keep(bias, new))
        if self._quantile:
            q_LE = self._mean_over_micro_and_ranks(self._quantile)
            m = 0.0 if self._warm else bal.quantile_momentum  # the warm start sets it outright
            for i, layer in enumerate(self.rule_layers):
                bias = layer.router.expert_bias
                layer.router.set_bias(keep(bias, balance.quantile_step(bias, q_LE[i], m)))
        if self._threshold:
            t_LE = self._mean_over_micro_and_ranks(self._threshold)
            for i, layer in enumerate(self.rule_layers):
                r = layer.router
                old = (r.threshold_E.clone(), r.threshold_ready.clone())
                r.update_threshold(t_LE[i])
                if skip is not None:
                    r.threshold_E.copy_(keep(old[0], r.threshold_E))
                    r.threshold_ready.copy_(keep(old[1], r.threshold_ready))
        if self.layers:  # (MTP MoE blocks on an all-dense main model: no table to close)
            self.acc.end_step(skip, nonfinite)

    # -- per log interval ---------------------------------------------------------------------------

    @torch.no_grad()
    def probe(self, autocast: torch.autocast) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the probe batch; return each MoE layer's router input and chosen ids."""
        inputs: list[torch.Tensor] = []
        ids: list[torch.Tensor] = []

        def keep(module: torch.nn.Module, args: tuple, out) -> None:
            inputs.append(args[0].detach())
            ids.append(out.ids_TK)

        hooks = [layer.router.register_forward_hook(keep) for layer in self.layers]
        was_training = self.model.training
        self.model.eval()
        try:
            # eager even where the blocks are compiled: a graph dynamo already built for another model of
            # the same code (an earlier run in this process) does not call these hooks
            with autocast, torch.compiler.set_stance("force_eager"):
                self.model(self.probe_BS)
        finally:
            for h in hooks:
                h.remove()
            self.model.train(was_training)
        return inputs, ids

    def record(self, step: int, autocast: torch.autocast, run_dir: Path,
               overflow: list[torch.Tensor | None] | None = None) -> dict:
        if not self.layers:
            if self.merge is None:
                return {}
            self.probe(autocast)  # a pipeline rank without MoE layers: its stages still run the probe
            return self._write(self.merge({"step": int(step), "layers": []}), run_dir)
        inputs, ids = self.probe(autocast)
        flip_bf16 = []
        for layer, x in zip(self.layers, inputs):
            with _unsharded(layer.router):
                flip_bf16.append(mstats.bf16_flip_rate(layer.router, x))
        flip_step = [mstats.flip_rate(p, n, num_experts=self.slots.selectable) if p is not None else None
                     for p, n in zip(self.prev_probe_ids, ids)]
        self.prev_probe_ids = ids
        self.acc.all_reduce(self.reduce)
        row = self.acc.record(step, flip_bf16=flip_bf16, flip_step=flip_step, overflow=overflow,
                              bias=[layer.router.expert_bias for layer in self.layers])
        if self.a2a_watch is not None:  # the slowest rank's all-to-all ms per step of the interval
            a2a_ms = self.a2a_watch.take_a2a_ms()
            self.reduce(a2a_ms, "max")
            row["a2a_ms"] = a2a_ms.item()
        if self.merge is not None:
            row = self.merge(row)
        return self._write(row, run_dir)

    def _write(self, row: dict, run_dir: Path) -> dict:
        if self.write:
            with (run_dir / "routing.jsonl").open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        self.monitor.check(row)
        return row


@contextlib.contextmanager
def _unsharded(module: torch.nn.Module) -> Iterator[None]:
    """Gather an FSDP unit's parameters for a call outside the model's forward (the router's bf16
    flip rate reads `router.weight` directly)."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def global_aux_terms(out: ModelOutput, global_counts_LE: torch.Tensor, top_k: int, num_tokens: int,
                     num_terms: int) -> torch.Tensor:
    """Sum over MoE layers of this micro-batch's global-batch aux-loss term (no coefficient)."""
    total = torch.zeros((), device=global_counts_LE.device)
    for i, m in enumerate(out.moe):
        total = total + balance.global_aux_loss(m.probs_mean_E, global_counts_LE[i], top_k,
                                                num_tokens=num_tokens, num_terms=num_terms)
    return total


def build_health(cfg: RunConfig, model: MoEModel, layout: Layout, probe_BS: torch.Tensor,
                 run_dir: Path) -> TrainHealth:
    """The trainer's routing health: reduced over the layout's ranks, written by rank 0, with the
    all-to-all alarm under EP."""
    p = layout.parallel
    merge = None
    if layout.pipeline is not None:
        ids, group = model.moe_block_ids(), layout.pipeline.meshes.pp_group
        merge = lambda row: merge_records(row, ids, group)  # noqa: E731
    return TrainHealth(model, run_dir, probe_BS, all_reduce=layout.reduce, echo=cfg.log.progress,
                       write=layout.is_main, alarm_warmup=cfg.train.warmup_steps,
                       a2a_alarm_ratio=p.a2a_alarm_ratio, a2a_watch=layout.comm_watch if p.ep_size > 1 else None,
                       merge=merge)
