"""Resuming a run: which configuration it continues with, and what may change.

A run directory holds the resolved `config.toml` of its latest start (or resume), and every checkpoint
holds the config it was written under (`trainer.pt`). `dropless train --resume` continues with the
run's own `config.toml`, with any `--set` overrides applied on top; `--config` does not replace it
(run.py says so when it differs). The checks below compare the config a resume would run with against
the checkpoint's, the config its weights were trained under, whoever builds the Trainer (CLI or API).

What may change on resume:
- Nothing under `model.` that defines the network or how it routes: parameter shapes, architecture
  (layers, heads, widths, activation, norms, positions, shared experts), the router (strategy, score
  function, top-k, groups, the bias buffer, capacity). A checkpoint's weights belong to one network,
  and a change that keeps every shape (top_k, score_func) would load silently and train another
  model. Such a change is a ValueError naming the field with both values. The exceptions, which
  change how the same network is computed or trained, never what it is, are listed in fixed_fields.py.
- `data.tokenizer` and `data.tokenizer_path` are refused as well: the embedding rows are one
  tokenizer's vocabulary (another tokenizer.json would silently train them under other ids).
- Everything else (train.*, data.*, log.*, parallel.*) may change; each change is printed and written to
  metrics.jsonl in the resume row `{"step", "resumed_from", "world_size", "config_changes"}`, with
  what a change means for the resumed run in its "notes".
  `train.steps` must be at least the checkpoint's step. The learning rate is a function of the step
  and of train.steps, warmup_steps, schedule, ...: a longer cosine run continues on the new, longer
  curve from the resumed step (a jump up in lr); a WSD run extends cleanly while on its plateau.
- `train.optimizer` may change (adamw, adamw_bf16, muon, either way): the checkpoint's weights load,
  its optimizer state (another optimizer's: other keys and meanings) does not, and the new optimizer
  starts fresh at the resumed step (zero moments and momenta, its step count at 0: bias correction
  restarts), which the resume note says. Unchanged, the optimizer state loads as always (exact).
  The optimizer's settings (train.beta1, beta2, eps, weight_decay, ...) are the new config's: a
  checkpoint's param groups hold them too, and dist_checkpoint.load puts the built ones back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig, apply_overrides, from_dict, load_config, to_dict
from ..fixed_fields import MUTABLE_MODEL_FIELDS, flatten, is_fixed

CONFIG_FILE = "config.toml"

Changes = dict[str, tuple[Any, Any]]  # dotted field -> (checkpoint's value, new value)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> Changes:
    """Fields whose values differ between two config dicts (both filled with defaults first, so a
    field added to the tree since `old` was written counts as unchanged at its default)."""
    a = flatten(to_dict(from_dict(RunConfig, old)))
    b = flatten(to_dict(from_dict(RunConfig, new)))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def check_resume_config(saved: dict[str, Any], cfg: RunConfig, step: int) -> Changes:
    """The changes from the checkpoint's config `saved` (written at `step`) to `cfg`; a ValueError
    naming the field and both values for a change a resumed run cannot make."""
    changes = config_changes(saved, to_dict(cfg))
    for name, (old, new) in changes.items():
        if is_fixed(name):
            mutable = ", ".join(m + "*" if m.endswith(".") else m for m in MUTABLE_MODEL_FIELDS)
            raise ValueError(
                f"{name}={new!r}: the checkpoint was trained with {name}={old!r}, and a resumed run keeps "
                f"the model's shape and routing (under model. only {mutable} may change); start a new "
                "run (another --run-dir) to train a different model")
    if cfg.train.steps < step:
        raise ValueError(f"train.steps={cfg.train.steps}: the checkpoint is already at step {step}; "
                         f"train.steps must be >= {step} to resume")
    return changes


def optimizer_note(changes: Changes) -> str | None:
    """The note for a resume that changed train.optimizer (its state starts fresh), else None."""
    if "train.optimizer" not in changes:
        return None
    old, new = changes["train.optimizer"]
    return (f"train.optimizer changed from {old!r} to {new!r}: the checkpoint's weights are loaded and its "
            f"{old} state is not; {new} starts from a fresh state (zero moments, step count 0)")


def describe(changes: Changes) -> list[str]:
    return [f"{name}: {old!r} -> {new!r}" for name, (old, new) in changes.items()]


def report_resume(path: Path, state: dict[str, Any], world_size: int, changes: Changes, metrics: Any,
                  notes: list[str] | None = None) -> None:
    """Say where the run resumed, what changed and what that means (`notes`): stdout, and one row of
    metrics.jsonl (a JsonlLog)."""
    step, saved_world = int(state["step"]), int(state.get("world_size", 1))
    moved = f" (written by {saved_world} processes, now {world_size})" if saved_world != world_size else ""
    print(f"resumed from {path} at step {step}{moved}")
    for line in describe(changes):
        print(f"config change on resume: {line}")
    for note in notes or []:
        print(f"note on resume: {note}")
    row = {"step": step, "resumed_from": Path(path).name, "world_size": world_size,
           "saved_world_size": saved_world, "config_changes": {k: list(v) for k, v in changes.items()}}
    metrics.write({**row, "notes": notes} if notes else row)


def run_config(run_dir: Path, saved: dict[str, Any] | None, overrides: list[str]) -> RunConfig:
    """The config a resume continues with: the run's config.toml (or, if it is missing, the checkpoint's
    config `saved`), with the `--set` overrides applied."""
    path = Path(run_dir) / CONFIG_FILE
    if path.is_file():
        return load_config(path, overrides)
    if saved is None:
        raise FileNotFoundError(f"--resume: {path} is missing and there is no checkpoint config to use")
    return apply_overrides(from_dict(RunConfig, saved), overrides)


def config_file_note(given: RunConfig, run: RunConfig, name: str) -> str | None:
    """What `--config NAME` on resume would have changed, which is ignored; None when it matches."""
    diff = config_changes(to_dict(run), to_dict(given))
    if not diff:
        return None
    fields = "; ".join(f"{k} (run: {a!r}, --config: {b!r})" for k, (a, b) in diff.items())
    return (f"note: --config {name} is ignored on --resume: the run continues with its own {CONFIG_FILE} "
            f"(change fields with --set). It differs from the run's config in: {fields}")
