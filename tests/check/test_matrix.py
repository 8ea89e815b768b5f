"""The combination matrix (src/dropless/check/): the generator's coverage proof, every refused pair
refused properly through `dropless train`, the stage runner's verdicts, and a handful of rows through
every stage. The whole matrix runs from .ci/run (`python -m dropless.check.matrix`)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from dropless import cli
from dropless.check import covering, hf_check, runner
from dropless.config import apply_overrides
from dropless.check import factors as fx
from dropless.check.refusals import check_refused_pairs
from dropless.check.row import run_row
from dropless.check.stages import NAMES


@pytest.fixture(scope="module")
def matrix() -> covering.Matrix:
    return covering.generate()


def test_family_rows_are_their_family() -> None:
    fs = fx.factors()
    for family in fx.FAMILY_ROWS:
        values = [fs[f][v] for f, v in enumerate(fx.family_row(family))]
        assert covering.refusal(values) is None
        cfg = apply_overrides(covering.base_config(), covering.overrides(values))
        assert hf_check.family(cfg.model) == family


def test_factor_table_is_one_line_per_knob() -> None:
    fs = fx.factors()
    setters: dict[str, str] = {}
    for f in fs:
        assert f[0].overrides == (), f"{f[0].factor}: the first value is the default (no override)"
        assert len({v.label for v in f}) == len(f), f"{f[0].factor}: labels repeat"
        for v in f:
            assert covering.refusal([v]) is None, f"{v.factor}={v.label} is refused on its own"
            for name in v.fields:
                assert setters.setdefault(name, v.factor) == v.factor, f"{name} set by {setters[name]} and {v.factor}"


def test_every_allowed_pair_is_covered_by_an_accepted_row(matrix: covering.Matrix) -> None:
    missed, refused_rows = covering.coverage(matrix)
    assert not refused_rows and not missed, (refused_rows, sorted(missed)[:5])
    # the refused pairs are exactly those validation refuses, each with a message naming both values
    assert set(matrix.allowed) | set(matrix.refused) == set(covering.all_pairs(matrix.factors))
    for pair, message in matrix.refused.items():
        assert covering.refusal(list(matrix.pair_values(pair))) == message
        assert covering.refusal_names_both(message, *matrix.pair_values(pair)), message


@pytest.mark.slow
def test_generator_is_deterministic(matrix: covering.Matrix) -> None:
    assert covering.generate().rows == matrix.rows


def test_refused_pairs_through_train(matrix: covering.Matrix) -> None:
    assert check_refused_pairs(matrix) == []


def test_cli_table_matches() -> None:
    assert cli.COMMANDS["check-matrix"][0] == "dropless.check.matrix"
    for command, module in runner.MODULES.items():
        name = command.split()[-1]
        assert (cli.BENCHMARKS[name] if command.startswith("bench ") else cli.COMMANDS[command][0]) == module


# --- the runner's verdicts, on a stand-in command -----------------------------------------------------

def _fake_command(monkeypatch: pytest.MonkeyPatch, main) -> None:  # noqa: ANN001
    module = types.ModuleType("fake_command")
    module.main = main
    monkeypatch.setitem(sys.modules, "fake_command", module)
    monkeypatch.setitem(runner.MODULES, "fake", "fake_command")


def _refuse(message: str, write: Path | None = None):  # noqa: ANN202
    def main(_argv: list[str]) -> int:
        if write is not None:
            write.write_text("half")
        print(f"dropless fake: error: {message}", file=sys.stderr)
        return 2
    return main


def test_refusal_naming_a_field_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_command(monkeypatch, _refuse("model.d_model=3: must be even"))
    with pytest.raises(runner.Refused, match="model.d_model=3"):
        runner.invoke("fake", [], tmp_path)


@pytest.mark.parametrize("case", ["names no field", "writes first", "exit 1", "raises"])
def test_other_endings_fail(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def raises(_argv: list[str]) -> int:
        raise RuntimeError("boom")

    main = {"names no field": _refuse("something is wrong"),
            "writes first": _refuse("model.d_model=3: must be even", tmp_path / "out"),
            "exit 1": lambda _argv: 1, "raises": raises}[case]
    _fake_command(monkeypatch, main)
    with pytest.raises(runner.Failed):
        runner.invoke("fake", [], tmp_path)


# --- rows through every stage ----------------------------------------------------------------------

def _row(**labels: str) -> list[str]:
    values = [next(v for v in f if v.label == labels.get(f[0].factor, f[0].label)) for f in fx.factors()]
    return covering.overrides(values)


ALL_OK = {s: "ok" for s in NAMES}
# (row values, the stages refused; every other stage ok). The refusals are the row's own: expert
# choice depends on the batch (no KV cache, no record of ids, no replay), serves no other top_k, and
# no HF family has it; a norm_top_k run cannot replay a record (its denominator is not in one), and
# no family has an expert bias with softmax scores.
ROWS = {
    "defaults": ({}, {}),
    "expert_choice": (dict(strategy="expert_choice", score="sigmoid", shared="shared1", activation="geglu",
                           tied="untied"),
                      {"serve": "refused", "gen-rec": "refused", "record": "refused", "export": "refused",
                       "import": "-", "replay": "-"}),
    "top1 knobs": (dict(top_k="k1", weights="norm_top_k3", balance="bias-sign", optimizer="muon",
                        layers="dense-prefix1", offload="experts"),
                   {"export": "refused", "import": "-", "replay": "refused"}),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_rows_through_every_stage(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    labels, refused = ROWS[name]
    monkeypatch.chdir(tmp_path)
    result = run_row({"overrides": _row(**labels), "stages": NAMES}, tmp_path)
    assert result["status"] == {**ALL_OK, **refused}, (result["status"], result["failures"], result["notes"])
