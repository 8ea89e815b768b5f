"""The stages of a row: every command that takes a run, in the order a user would run them.

Each stage calls commands through `runner.invoke` (in this process) and then checks what they wrote:
checkpoints at the expected step, finite losses, equal greedy tokens with and without the KV cache,
records and reports that load. A stage is `ok`, `refused` (every call it made was refused with a
field named, nothing written) or a failure; a stage whose inputs are missing (`needs`) is not run.
A stage with several calls is ok when at least one call worked and the others were refused.
A command that only loads the model (all but train and plan) refusing over a field that only changes
how a run trains (model.recompute, model.offload, parallel.*) is a failure, not a refusal.

Sizes: 2 training steps, then one more per resume; generation of 8 tokens from two prompts of
different lengths (prompt + new tokens stay inside model.max_seq_len = 32).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..config import RunConfig
from ..expert_slots import ExpertSlots
from ..data.routing_record import RoutingRecord
from ..runs import checkpoint as ckpt
from . import greedy, hf_check
from .data_setup import data_sets
from .factors import PRESET
from .runner import Call, Failed, Refused, Skipped, invoke

PROMPTS = ["def ", "import os\n"]
# fields that change how a run trains, never what its model computes: a command that only loads the
# model (evaluate, generate, quantize, export, ...) has no reason to refuse over them
TRAINING_ONLY = re.compile(r"(?<![\w.])(model\.recompute|model\.offload|parallel\.[a-z_]+)")
NEW_TOKENS = 8
OTHER_OPTIMIZER = {"adamw": "muon", "adamw_bf16": "adamw", "muon": "adamw"}


@dataclass
class Ctx:
    """One row's run: its config, overrides (BASE + the row's), folder and the files stages left."""

    cfg: RunConfig
    sets: list[str]
    root: Path
    options: dict[str, str] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def row_world(self) -> int:
        p = self.cfg.parallel
        return p.ep_size * p.pp_size

    @property
    def world(self) -> int:
        """The processes the run trains with now: the row's, until resume+ moves an EP run to one."""
        return 1 if self.options.get("one_process") else self.row_world

    def call(self, command: str, *argv: str) -> Call:
        try:
            return invoke(command, [str(a) for a in argv], self.root)
        except Refused as r:
            training_only = TRAINING_ONLY.search(str(r))
            if command not in ("train", "plan") and training_only:
                raise Failed(f"dropless {command} refused over {training_only[0]}, which only changes how a run "
                             f"trains: {r}") from None
            raise

    def train(self, *argv: str) -> Call:
        nproc = ["--nproc", str(self.world)] if self.world > 1 else []
        return self.call("train", "--run-dir", self.run, *nproc, *argv)

    def some(self, stage: str, calls: list[Callable[[], object]]) -> None:
        """Run each call; refusals are noted. All refused: the stage is refused (first message)."""
        refused = []
        for c in calls:
            try:
                c()
            except Refused as r:
                refused.append(str(r))
        self.notes.setdefault(stage, []).extend(f"refused: {m}" for m in refused)
        if refused and len(refused) == len(calls):
            raise Refused(refused[0])


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise Failed(what)


def check_steps(ctx: Ctx, step: int) -> None:
    """A complete checkpoint at `step`, finite losses on every logged step, no skipped step."""
    latest = ckpt.latest_checkpoint(ctx.run)
    expect(latest is not None and latest.name == ckpt.checkpoint_name(step),
           f"latest checkpoint {latest and latest.name}, expected {ckpt.checkpoint_name(step)}")
    rows = [json.loads(line) for line in (ctx.run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    expect(any(s == step - 1 for s, _ in losses), f"no loss logged for step {step - 1}")
    bad = [(s, x) for s, x in losses if not (isinstance(x, (int, float)) and math.isfinite(x))]
    expect(not bad, f"non-finite losses {bad}")
    summary = json.loads((ctx.run / "summary.json").read_text())
    expect(summary.get("nonfinite_steps", 0) == 0, f"{summary.get('nonfinite_steps')} non-finite steps skipped")


def latest_step(ctx: Ctx) -> int:
    return int(ckpt.latest_checkpoint(ctx.run).name.rsplit("_", 1)[1])


def finite_json(path: Path, *keys: str) -> None:
    data = json.loads(path.read_text())
    rows = data.get("rows", [data])
    for r in rows:
        for k in keys:
            expect(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]), f"{path.name}: {k}={r.get(k)}")


def train(ctx: Ctx) -> None:
    base = dict(o.split("=", 1) for o in ctx.sets)
    ctx.sets = [*ctx.sets, *data_sets(ctx.options.get("data", ""), ctx.root, base, ctx.call)]
    ctx.train(*sets(ctx.sets))
    check_steps(ctx, 2)


def resume(ctx: Ctx) -> None:
    ctx.train("--resume", "--set", "train.steps=3")
    check_steps(ctx, 3)


def resume_changed(ctx: Ctx) -> None:
    """One more step with train.lr changed (and train.optimizer, where the row asks). An EP run
    continues in one process from here (checkpoints load at any world size): two launches of
    torchrun per EP row (train, resume) keep the matrix inside CI's time."""
    step = latest_step(ctx) + 1
    changes = [f"train.steps={step}", "train.lr=5e-3"]
    if ctx.options.get("resume_optimizer") == "true":
        changes.append(f"train.optimizer={OTHER_OPTIMIZER[ctx.cfg.train.optimizer]}")
    if ctx.row_world > 1:
        changes += ["parallel.ep_size=1", "parallel.pp_size=1", "parallel.replicate_hot_experts=0"]
        ctx.options["one_process"] = "true"
    ctx.train("--resume", *sets(changes))
    check_steps(ctx, step)
    resumed = [json.loads(r) for r in (ctx.run / "metrics.jsonl").read_text().splitlines() if "config_changes" in r]
    expect(bool(resumed) and "train.lr" in resumed[-1]["config_changes"], "the lr change is not logged")


def evaluate(ctx: Ctx) -> None:
    out = ctx.root / "eval.json"
    ctx.call("evaluate", "--run-dir", ctx.run, "--device", "cpu", "--max-batches", "1", "--json", out)
    finite_json(out, "val_loss")


def serve(ctx: Ctx) -> None:
    """Fewer experts when serving: evaluate at K1 = 1, the sweep, and generate at K1 = 1."""
    k = ctx.cfg.model.moe.top_k
    flags = ["--serve-top-k", "1", *(["--serve-norm-top-k", str(k)] if k > 1 else ["--serve-renorm", "kept"])]

    def one() -> None:
        out = ctx.root / "serve.json"
        ctx.call("evaluate", "--run-dir", ctx.run, "--device", "cpu", "--max-batches", "1", *flags, "--json", out)
        finite_json(out, "val_loss")

    def sweep() -> None:
        out = ctx.root / "sweep.json"
        ctx.call("evaluate", "--run-dir", ctx.run, "--device", "cpu", "--max-batches", "1", "--serve-sweep",
                 "--json", out)
        finite_json(out, "val_loss")

    def gen() -> None:
        ctx.call("generate", "--run-dir", ctx.run, *_prompts(), "--serve-top-k", "1", "--device", "cpu")

    ctx.some("serve", [one, sweep, gen])


def _prompts() -> list[str]:
    return [a for p in PROMPTS for a in ("--prompt", p)] + ["--max-new-tokens", str(NEW_TOKENS),
                                                            "--temperature", "0"]


def generate(ctx: Ctx) -> None:
    """Both paths print a sequence per prompt; then the cache is held to the recompute path through
    the Python API (greedy.py: its logits at every step, and the greedy tokens up to a tie)."""
    no_cache = ctx.call("generate", "--run-dir", ctx.run, *_prompts(), "--device", "cpu", "--no-cache").stdout
    expect(no_cache.count("--- [") == len(PROMPTS), f"generate printed {no_cache!r}")
    try:
        cached = ctx.call("generate", "--run-dir", ctx.run, *_prompts(), "--device", "cpu").stdout
    except Refused as r:
        ctx.notes.setdefault("gen", []).append(f"cache refused: {r}")
        return
    expect(cached.count("--- [") == len(PROMPTS), f"generate printed {cached!r}")
    ctx.notes.setdefault("gen", []).append(greedy.compare(ctx.run, PROMPTS, NEW_TOKENS))


def generate_record(ctx: Ctx) -> None:
    rec = ctx.root / "gen.rec"
    ctx.call("generate", "--run-dir", ctx.run, *_prompts(), "--device", "cpu", "--record-routing", rec)
    check_record(ctx, rec, len(PROMPTS))


def check_record(ctx: Ctx, path: Path, n: int) -> None:
    r = RoutingRecord.load(path)
    m = ctx.cfg.model
    expect(len(r.tokens) == n, f"{path.name}: {len(r.tokens)} sequences, expected {n}")
    for ids in r.ids:
        expect(ids.shape[0] == m.n_moe_layers and ids.shape[2] == m.moe.top_k, f"{path.name}: ids {tuple(ids.shape)}")
        selectable = ExpertSlots.from_config(m.moe).selectable  # identity experts are routing ids too
        expect(bool((ids >= 0).all() and (ids < selectable).all()), f"{path.name}: expert id out of range")


def record(ctx: Ctx) -> None:
    """record-routing of the generated tokens (or two validation windows), and their mismatch."""
    gen, out = ctx.root / "gen.rec", ctx.root / "full.rec"
    source = ["--from", gen] if gen.exists() else ["--val", "2"]
    ctx.call("record-routing", "--run-dir", ctx.run, *source, "--device", "cpu", "--out", out)
    check_record(ctx, out, len(PROMPTS) if gen.exists() else 2)
    if gen.exists():
        ctx.call("routing-mismatch", gen, out)


def quantize(ctx: Ctx) -> None:
    """Each 4-bit format packed into a new run, which evaluates and generates."""
    def one(fmt: str) -> Callable[[], None]:
        def run() -> None:
            out, js = ctx.root / f"q-{fmt}", ctx.root / f"q-{fmt}.json"
            ctx.call("quantize", ctx.run, "--experts", fmt, "--out", out)
            ctx.call("evaluate", "--run-dir", out, "--device", "cpu", "--max-batches", "1", "--json", js)
            finite_json(js, "val_loss")
            ctx.call("generate", "--run-dir", out, *_prompts(), "--device", "cpu", "--no-cache")
        return run

    ctx.some("quant", [one("mxfp4"), one("nvfp4")])


def quantize_report(ctx: Ctx) -> None:
    out = ctx.root / "q-report.json"
    ctx.call("quantize", ctx.run, "--report", "--max-batches", "1", "--json", out)
    expect(out.exists(), "no report written")


def export(ctx: Ctx) -> None:
    """export-hf of the run; a LoRA run is merged first (merge-lora), and that merged run exported."""
    family = hf_check.family(ctx.cfg.model)
    out, run = ctx.root / "hf", _full_run(ctx)
    ctx.call("export-hf", run, "--out", out, "--family", family or hf_check.FALLBACK)
    expect(family is not None, "exported a model no family can express")
    ctx.notes.setdefault("export", []).append(hf_check.load_export(run, out))


def _full_run(ctx: Ctx) -> Path:
    """The run itself, or a LoRA run's adapters merged into its base (once)."""
    if not ctx.cfg.train.lora.enabled:
        return ctx.run
    merged = ctx.root / "merged"
    if not merged.exists():
        ctx.call("merge-lora", ctx.run, "--out", merged)
    return merged


def import_hf(ctx: Ctx) -> None:
    out = ctx.root / "imported"
    source = hf_check.with_byte_tokenizer(ctx.root / "hf", ctx.root / "hf-tok")
    ctx.call("import-hf", source, "--out", out)
    hf_check.compare_runs(_full_run(ctx), out)


def plan(ctx: Ctx) -> None:
    out = ctx.root / "plan.json"
    ctx.call("plan", PRESET, *sets(ctx.sets), "--world", str(ctx.row_world), "--json", out)
    expect(json.loads(out.read_text())["plan"]["peak"] > 0, "plan peak is 0")


def diagnose(ctx: Ctx) -> None:
    out = ctx.root / "health"
    ctx.call("diagnose", ctx.run, "--out", out)
    expect(any(out.glob("*.md")), "no report written")


def bench(ctx: Ctx) -> None:
    out = ctx.root / "bench.json"
    ctx.call("bench generate", "--run-dir", ctx.run, "--device", "cpu", "--contexts", "8", "--path-batches", "1",
             "--repeats", "1", "--threads", "1", "--json", out)
    expect(out.exists(), "no figures written")


def replay(ctx: Ctx) -> None:
    """Training on the recorded routing (R3) for one more step."""
    rec = next((p for p in (ctx.root / "gen.rec", ctx.root / "full.rec") if p.exists()), None)
    if rec is None:
        raise Skipped("no routing record to replay: generate and record-routing were refused")
    step = latest_step(ctx) + 1
    ctx.train("--resume", "--replay-routing", rec, "--set", f"train.steps={step}")
    check_steps(ctx, step)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Ctx], None]
    needs: tuple[str, ...] = ("train",)  # stages that must be ok first (and run when this one is asked for)


STAGES = [
    Stage("train", train, ()), Stage("resume", resume), Stage("resume+", resume_changed),
    Stage("eval", evaluate), Stage("serve", serve), Stage("gen", generate), Stage("gen-rec", generate_record),
    Stage("record", record), Stage("quant", quantize), Stage("q-report", quantize_report),
    Stage("export", export), Stage("import", import_hf, ("train", "export")), Stage("plan", plan),
    Stage("diagnose", diagnose), Stage("bench", bench), Stage("replay", replay),
]
NAMES = [s.name for s in STAGES]
BY_NAME = {s.name: s for s in STAGES}
# replay trains on a record: generate's, else record-routing's (asked for with replay, not required ok)
PREREQUISITES = {"replay": ("gen-rec", "record")}


def selection(names: list[str]) -> list[str]:
    """The stages to run for `names`, with the stages they need, in pipeline order."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"--stages {','.join(unknown)}: unknown (stages: {', '.join(NAMES)})")
    wanted = set(names)
    for n in names:
        wanted |= set(BY_NAME[n].needs) | set(PREREQUISITES.get(n, ()))
    return [n for n in NAMES if n in wanted]
