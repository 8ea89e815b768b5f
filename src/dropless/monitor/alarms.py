"""Alarms: the symptom map of mission.md section 8 as rules over routing.jsonl rows.

Each rule reads one layer's row (plus a little history for dead experts and bias drift) and, when
it fires, yields an `Alarm` naming the layer, step, metric, value, threshold, the likely cause and
what to do. `HealthMonitor.check(record)` prints each (layer, kind) once per run and appends each
first firing to `health.jsonl` in the run directory (format in docs/monitoring.md). The thresholds
are defaults from the sources' figures, overridable per run.

Rules:
- collapse: the interval's global MaxVio above `maxvio_global`, or one expert taking more than
  `max_token_share` of the tokens (and more than twice its fair share k/E).
- dead_expert: an expert with no tokens over `dead_window` consecutive log intervals.
- rogue_expert: output RMS max/median above `rms_max_over_median` (5,700x was observed).
- dying_expert: output RMS min/median below `rms_min_over_median`.
- aux_blind: global MaxVio is high while the aux loss stays near its minimum 1.0: the router's
  probabilities are flat, the real loads are not. "Near" is relative to the loads: a router whose
  probabilities follow its loads reads aux - 1 close to E * sum_e f_e^2 - 1 (f: the interval's load
  shares; the default run's rows read 0.47 to 3 times it), a flat router reads 0; the alarm fires
  below `aux_blind_ratio` times it.

"The interval's global MaxVio" is `maxvio_global_mean`, the mean over the interval's steps of each
step's global MaxVio (the row's `maxvio_global` is the worst single step, which swings with the
batch: the default run's worst steps read twice its means). Rows without the mean (records written
outside the trainer) fall back to `maxvio_global`.
- bias_drift: the largest |expert bias| above `bias_abs_max` and still growing over
  `drift_window` intervals.
- dropped / overflow: pairs dropped or EP buffer overflow (never silent on a dropless path).
- bf16_flips: the bf16-vs-fp32 selection flip rate above `flip_bf16`.
- nonfinite (whole model, `layer` None): steps of the interval skipped for a non-finite loss or
  gradient norm (the record's `nonfinite_steps`, train/nonfinite.py).
- a2a_slow (whole model): the interval's EP all-to-all milliseconds per step (the record's `a2a_ms`,
  the slowest rank's, distributed/watch.py) above `a2a_slow_ratio` x the run's own baseline: the
  median of the `a2a_baseline_rows` rows after the first (the first log step, step 0, pays for
  first-call setup). A slow link shows here while all-reduce-bound figures look fine.

Balance alarms wait for `warmup_steps` (the trainer passes the learning-rate warm-up);
`thresholds_for_run` gives a finished run's thresholds, so a report that replays the rules over its
routing.jsonl holds the same alarms back as the trainer did.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

ADVICE = {
    "collapse": ("routing collapse: the router sends most tokens to few experts (aux loss too weak, "
                 "bias rule off or too slow, learning rate too high for the router)",
                 "raise balance.aux_loss_coeff or enable loss-free bias (balance.bias_update_rate) or "
                 "quantile balancing; check the router learning rate; compare global with local MaxVio"),
    "dead_expert": ("dead expert: the router never selects it, so it gets no gradient and cannot recover",
                    "enable loss-free bias or quantile balancing (they lift unloaded experts); consider "
                    "re-initialising the expert from a live one"),
    "rogue_expert": ("rogue expert: its outputs grew far beyond the layer's median (weights or "
                     "activations blowing up; often precedes a loss spike)",
                     "set moe.act_clamp (e.g. 10) or act_softcap; lower the learning rate; check the "
                     "expert's weight norm and low-precision scales"),
    "dying_expert": ("dying expert: its output norm is collapsing toward zero (few tokens, or weights "
                     "decayed)",
                     "check its token count and weight decay; per-expert orthogonalised updates (Muon) "
                     "keep rarely used experts moving"),
    "aux_blind": ("the aux loss reads balanced (about 1.0) because the router probabilities are flat, "
                  "while the real loads are skewed (ties broken by index, or a bias doing the selecting)",
                  "judge balance by MaxVio, not the aux loss; check router initialisation and the "
                  "router learning rate; use loss-free bias on real counts"),
    "bias_drift": ("expert bias drifting without bound: the bias rule cannot balance this expert "
                   "(its scores are out of reach, or the step u is too large)",
                   "lower balance.bias_update_rate, or switch to quantile balancing; check the "
                   "expert's scores"),
    "dropped": ("pairs dropped: a capacity factor is set or a buffer is too small",
                "use the dropless path (moe.capacity_factor=None)"),
    "overflow": ("EP receive buffer overflow: routing demand exceeded ragged_buffer_factor",
                 "set parallel.ragged_buffer_factor=auto, raise it, or set parallel.on_overflow=retry "
                 "(or spill)"),
    "bf16_flips": ("the router runs close to ties: a bf16 router would flip expert choices",
                   "keep the router in fp32 (the default); a z-loss keeps logits from growing"),
    "nonfinite": ("steps skipped: their loss or gradient norm was NaN or Inf (parameters, optimizer "
                  "state and router buffers were left unchanged)",
                  "a few are harmless; many point to a learning rate too high (lower train.lr, longer "
                  "warm-up), bf16 overflow (train.dtype=fp32, moe.act_clamp) or bad data; the run stops "
                  "after train.max_nonfinite_steps in a row"),
    "a2a_slow": ("the expert-parallel all-to-all takes longer than it did early in the run: a slow or "
                 "congested link, a straggler rank (a hot expert, a throttled or shared node) that the "
                 "others wait for inside the exchange",
                 "compare `dropless bench a2a --nproc N` on the same group (all-to-all against "
                 "all-reduce bandwidth) with a healthy node; look for the rank whose step time grew; "
                 "check the interconnect's error and congestion counters"),
}


BALANCE_KINDS = frozenset({"collapse", "dead_expert", "aux_blind", "bias_drift"})


@dataclass
class AlarmThresholds:
    maxvio_global: float = 2.0
    max_token_share: float = 0.5
    dead_window: int = 3
    rms_max_over_median: float = 100.0
    rms_min_over_median: float = 1e-3
    aux_blind_ratio: float = 0.2  # aux - 1 below this times (E * sum f^2 - 1) reads "flat"
    aux_blind_maxvio: float = 1.0
    bias_abs_max: float = 1.0
    drift_window: int = 3
    flip_bf16: float = 0.1
    # Balance alarms (collapse, dead expert, aux_blind, bias drift) stay quiet before this step: routing
    # from a freshly initialised router swings hard during the learning-rate warm-up and settles after.
    # Correctness alarms (drops, overflow, rogue or dying experts, bf16 flips) are never held back.
    warmup_steps: int = 0
    a2a_slow_ratio: float = 1.5  # parallel.a2a_alarm_ratio
    a2a_baseline_rows: int = 5


@dataclass
class Alarm:
    kind: str
    layer: int | None  # None: the whole model (nonfinite)
    step: int
    metric: str
    value: float
    threshold: float
    cause: str
    action: str
    expert: int | None = None

    def line(self) -> str:
        where = "model" if self.layer is None else f"layer {self.layer}"
        where += f" expert {self.expert}" if self.expert is not None else ""
        return (f"[dropless health] step {self.step} {where}: {self.kind}: {self.metric}={self.value:.4g} "
                f"(threshold {self.threshold:.4g}). Likely: {self.cause}. Do: {self.action}.")


def load_excess(counts: list[int]) -> float:
    """E * sum_e f_e^2 - 1 for the load shares f_e = counts / total: what the aux loss E * sum_e f_e P_e
    reads above 1 when the router's probabilities P equal the loads; 0 for balanced loads or none."""
    total = sum(counts)
    return len(counts) * sum((c / total) ** 2 for c in counts) - 1.0 if total else 0.0


def _alarm(kind: str, layer: int | None, step: int, metric: str, value: float, threshold: float,
           expert: int | None = None) -> Alarm:
    cause, action = ADVICE[kind]
    return Alarm(kind, layer, step, metric, float(value), float(threshold), cause, action, expert)


@dataclass
class HealthMonitor:
    """Stateful rule runner. `check(record)` per routing.jsonl row; returns the alarms that fired."""

    run_dir: str | Path | None = None
    thresholds: AlarmThresholds = field(default_factory=AlarmThresholds)
    echo: bool = True
    _zero_streak: dict[tuple[int, int], int] = field(default_factory=dict)
    _bias_hist: dict[int, list[float]] = field(default_factory=dict)
    _reported: set[tuple[int | None, str]] = field(default_factory=set)
    _a2a_rows: list[float] = field(default_factory=list)

    def check(self, record: dict) -> list[Alarm]:
        step = int(record["step"])
        fired = [a for i, row in enumerate(record["layers"]) for a in self._rules(i, step, row)]
        if record.get("nonfinite_steps"):
            fired.append(_alarm("nonfinite", None, step, "nonfinite_steps", record["nonfinite_steps"], 0))
        fired += self._a2a_rule(step, record.get("a2a_ms"))
        if step < self.thresholds.warmup_steps:
            fired = [a for a in fired if a.kind not in BALANCE_KINDS]
        new = []
        for a in fired:
            key = (a.layer, a.kind)
            if key in self._reported:
                continue
            self._reported.add(key)
            new.append(a)
            if self.echo:
                print(a.line())
            if self.run_dir is not None:
                path = Path(self.run_dir) / "health.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as fh:
                    fh.write(json.dumps(asdict(a)) + "\n")
        return new

    def _a2a_rule(self, step: int, a2a_ms: float | None) -> list[Alarm]:
        th = self.thresholds
        if a2a_ms is None:
            return []
        self._a2a_rows.append(a2a_ms)
        base_rows = self._a2a_rows[1:th.a2a_baseline_rows + 1]  # the first row: step 0's setup
        if len(self._a2a_rows) <= th.a2a_baseline_rows + 1:  # still the baseline
            return []
        base = statistics.median(base_rows)
        if base > 0 and a2a_ms > th.a2a_slow_ratio * base:
            return [_alarm("a2a_slow", None, step, "a2a_ms_over_baseline", a2a_ms / base, th.a2a_slow_ratio)]
        return []

    def _rules(self, i: int, step: int, row: dict) -> Iterator[Alarm]:
        th = self.thresholds
        counts = row["counts"]
        vio_name = "maxvio_global_mean" if row.get("maxvio_global_mean") is not None else "maxvio_global"
        vg = row.get(vio_name)
        if vg is not None and vg > th.maxvio_global:
            yield _alarm("collapse", i, step, vio_name, vg, th.maxvio_global)
        else:
            total = sum(counts)
            if total:
                k = row.get("top_k", 1)
                share = max(counts) * k / total  # fraction of the tokens that visit the busiest expert
                # "most tokens" only means collapse when it is well above the fair share k/E
                if share > th.max_token_share and share > 2 * k / len(counts):
                    yield _alarm("collapse", i, step, "max_token_share", share, th.max_token_share,
                                 expert=counts.index(max(counts)))
        for e, c in enumerate(counts):
            streak = self._zero_streak.get((i, e), 0) + 1 if c == 0 else 0
            self._zero_streak[(i, e)] = streak
            if streak >= th.dead_window:
                yield _alarm("dead_expert", i, step, "intervals_without_tokens", streak, th.dead_window, e)
        rmax, rmin = row.get("rms_max_over_median"), row.get("rms_min_over_median")
        if rmax is not None and rmax > th.rms_max_over_median:
            yield _alarm("rogue_expert", i, step, "rms_max_over_median", rmax, th.rms_max_over_median)
        if rmin is not None and rmin < th.rms_min_over_median:
            yield _alarm("dying_expert", i, step, "rms_min_over_median", rmin, th.rms_min_over_median)
        aux = row.get("aux_loss")
        if aux is not None and vg is not None and vg > th.aux_blind_maxvio:
            excess = load_excess(counts)
            if excess > 0 and aux - 1.0 < th.aux_blind_ratio * excess:
                yield _alarm("aux_blind", i, step, vio_name, vg, th.aux_blind_maxvio)
        b = row.get("bias_abs_max")
        if b is not None:
            hist = self._bias_hist.setdefault(i, [])
            hist.append(b)
            recent = hist[-(th.drift_window + 1):]
            growing = len(recent) > th.drift_window and all(x < y for x, y in zip(recent, recent[1:]))
            if b > th.bias_abs_max and growing:
                yield _alarm("bias_drift", i, step, "bias_abs_max", b, th.bias_abs_max)
        if row.get("dropped"):
            yield _alarm("dropped", i, step, "dropped", row["dropped"], 0)
        if row.get("overflow"):
            yield _alarm("overflow", i, step, "overflow", row["overflow"], 0)
        fb = row.get("flip_bf16")
        if fb is not None and fb > th.flip_bf16:
            yield _alarm("bf16_flips", i, step, "flip_bf16", fb, th.flip_bf16)


def thresholds_for_run(run_dir: str | Path) -> AlarmThresholds:
    """The thresholds the trainer used for the run in `run_dir`: the defaults, with the balance alarms
    held back for the run's learning-rate warm-up (train.warmup_steps in its config.toml; 0 when the
    run has no config, e.g. a record written outside the trainer) and its all-to-all alarm ratio."""
    from ..configtree import load_toml

    path = Path(run_dir) / "config.toml"
    cfg = load_toml(path) if path.is_file() else {}
    return AlarmThresholds(warmup_steps=int(cfg.get("train", {}).get("warmup_steps", 0)),
                           a2a_slow_ratio=float(cfg.get("parallel", {}).get("a2a_alarm_ratio", 1.5)))


def read_alarms(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "health.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
