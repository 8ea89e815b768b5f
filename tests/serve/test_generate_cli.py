"""`dropless generate` and `dropless bench generate` on a tiny trained run: streaming, batches, the
recompute path, bad flags (exit 2, the flag named, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.bench.generate import main as bench_main
from dropless.serve.generate import generate
from dropless.serve.generate_cli import main
from dropless.runs.load import load_model
from dropless.train.loop import Trainer
from tiny_run import tiny


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run")
    Trainer(tiny("train.steps=3", "train.eval_every=3", "train.ckpt_every=3"), path).fit()
    return path


def cli(run_dir: Path, *extra: str) -> list[str]:
    return ["--run-dir", str(run_dir), "--device", "cpu", "--temperature", "0", "--max-new-tokens", "10",
            *extra]


def test_one_prompt_streams_the_api_text(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    model, _ = load_model(run_dir)
    ids = generate(model, [list(b"def ")], 10, temperature=0).tokens[0]
    assert main(cli(run_dir, "--prompt", "def ")) == 0
    expected = "def " + bytes(ids).decode("utf-8", errors="replace") + "\n"
    assert capsys.readouterr().out == expected
    assert main(cli(run_dir, "--prompt", "def ", "--no-cache")) == 0
    assert capsys.readouterr().out == expected


def test_batch_prints_each_sequence(run_dir: Path, capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import \n\nclass \n")
    assert main(cli(run_dir, "--prompt", "def ", "--prompts-file", str(prompts), "--top-p", "0.9",
                    "--repetition-penalty", "1.2", "--stop", "zzz")) == 0
    out = capsys.readouterr().out
    assert out.index("--- [0]") < out.index("--- [1]") < out.index("--- [2]")
    assert "\ndef " in out and "\nimport " in out and "\nclass " in out


@pytest.mark.parametrize("flag,value", [
    ("--temperature", "-1"), ("--top-k", "-2"), ("--top-p", "1.5"), ("--repetition-penalty", "0"),
    ("--max-new-tokens", "-3"), ("--max-new-tokens", "40"), ("--device", "tpu"), ("--dtype", "fp16"),
    ("--prompts-file", "/nonexistent/p.txt"), ("--stop", ""),
])
def test_bad_flags_exit_2_naming_the_flag(run_dir: Path, capsys: pytest.CaptureFixture, flag: str,
                                          value: str) -> None:
    args = cli(run_dir, "--prompt", "def ")
    if flag in args:
        i = args.index(flag)
        args[i + 1] = value
    else:
        args += [flag, value]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert flag in captured.err and captured.out == ""


def test_record_routing_file(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dropless.data.routing_record import RoutingRecord

    out = tmp_path / "gen.rec"
    assert main(cli(run_dir, "--prompt", "def ", "--prompt", "x", "--record-routing", str(out))) == 0
    rec = RoutingRecord.load(out)
    model, _ = load_model(run_dir)
    api = generate(model, [list(b"def "), list(b"x")], 10, temperature=0, record_routing=True)
    assert [t.tolist() for t in rec.tokens] == [list(b"def ") + api.tokens[0], list(b"x") + api.tokens[1]]
    assert all(torch.equal(a.to(torch.long), b) for a, b in zip(rec.ids, api.routing))
    assert rec.source == "kv-cache decode fp32"
    capsys.readouterr()
    missing = tmp_path / "no" / "gen.rec"
    assert main(cli(run_dir, "--prompt", "x", "--record-routing", str(missing))) == 2
    assert "--record-routing" in capsys.readouterr().err and not missing.parent.exists()


def test_run_without_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--run-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_bench_generate_runs_on_a_run_with_longer_contexts(run_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    # contexts past the run's max_seq_len (32): the weights load into a model with longer tables
    assert bench_main(["--run-dir", str(run_dir), "--device", "cpu", "--contexts", "8,40",
                       "--path-batches", "1,9", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["context"] for r in data["contexts"]] == [8, 40]
    assert all(r["decode_cache_tok_s"] > 0 and r["speedup"] > 0 for r in data["contexts"])
    assert [p["auto"] for p in data["moe_paths"]] == ["decode", "grouped"]  # CPU threshold: 8 tokens
    assert "speedup" in capsys.readouterr().out


def test_bench_generate_bf16_has_no_path_table(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Under autocast the decode path steps aside, so a path table would time the grouped path twice
    and label half of it "decode": a bf16 run prints none and says why."""
    out = tmp_path / "bench.json"
    assert bench_main(["--run-dir", str(run_dir), "--device", "cpu", "--dtype", "bf16", "--contexts", "8",
                       "--path-batches", "1", "--repeats", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["moe_paths"] == []
    assert "no MoE path table under --dtype bf16" in capsys.readouterr().out


@pytest.mark.parametrize("args,flag", [(["--contexts", "0,8"], "--contexts"), (["--batch", "0"], "--batch"),
                                       (["--config", "nope"], "--config"), (["--dtype", "x"], "--dtype")])
def test_bench_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], flag: str) -> None:
    out = tmp_path / "b.json"
    assert bench_main(args + ["--json", str(out), "--device", "cpu"]) == 2
    assert flag in capsys.readouterr().err and not out.exists()


def test_serve_top_k_flags_reach_the_model(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--serve-top-k 1 runs one expert per token (the record's K), and the text is the API's with the
    served config; K2 < K1 is refused before loading, naming the flag."""
    from dropless.data.routing_record import RoutingRecord
    from dropless.serve.serving import serving_map

    rec = tmp_path / "k1.rec"
    assert main(cli(run_dir, "--prompt", "def ", "--serve-top-k", "1", "--serve-norm-top-k", "2",
                    "--record-routing", str(rec))) == 0
    out = capsys.readouterr().out
    assert RoutingRecord.load(rec).ids[0].shape[-1] == 1
    model, _ = load_model(run_dir, model_cfg=serving_map(1, 2, "mass"))
    ids = generate(model, [list(b"def ")], 10, temperature=0).tokens[0]
    assert out == "def " + bytes(ids).decode("utf-8", errors="replace") + "\n"
    assert main(cli(run_dir, "--prompt", "def ", "--serve-top-k", "2", "--serve-norm-top-k", "1")) == 2
    assert "--serve-norm-top-k" in capsys.readouterr().err
