"""Several machines (`dropless train --nnodes M --node-rank I --master-addr HOST`, train/run.py): the
launcher's checks, the rendezvous it asks torchrun for, the ep group kept inside a node, and two
simulated nodes of 2 processes on loopback that train 20 steps and resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dropless.distributed.mesh import check_ep_in_node
from dropless.train import run
from tiny_run import TINY


def _nodes_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--nnodes", "2", "--node-rank", "0", "--nproc", "2", "--master-addr", "127.0.0.1",
            "--run-dir", str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "0"], "--nnodes 0: must be >= 1"),
    (["--node-rank", "1"], "--node-rank 1: only with --nnodes > 1"),
    (["--master-addr", "10.0.0.1"], "--master-addr 10.0.0.1: only with --nnodes > 1"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--run-dir", "d"], "needs --nproc P"),
    (["--nnodes", "2", "--nproc", "2", "--master-addr", "h", "--run-dir", "d"], "--node-rank None"),
    (["--nnodes", "2", "--node-rank", "2", "--nproc", "2", "--master-addr", "h", "--run-dir", "d"],
     "--node-rank 2: give this node's index, 0 .. 1"),
    (["--nnodes", "2", "--node-rank", "1", "--nproc", "2", "--run-dir", "d"], "needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "1", "--nproc", "2", "--master-addr", "h", "--master-port", "0",
      "--run-dir", "d"], "--master-port 0: must be 1 .. 65535"),
    (["--nnodes", "2", "--node-rank", "1", "--nproc", "2", "--master-addr", "h"], "needs --run-dir"),
])
def test_bad_node_flags_are_refused_before_anything_starts(argv, message, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run.main(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing launched


def test_an_ep_group_spanning_nodes_is_refused(tmp_path, capsys) -> None:
    check_ep_in_node(4, world=4, per_node=4)  # one node: anything the world allows
    check_ep_in_node(2, world=4, per_node=2)
    check_ep_in_node(1, world=6, per_node=3)
    with pytest.raises(ValueError, match="parallel.ep_size=4 does not divide the 2 processes per node"):
        check_ep_in_node(4, world=4, per_node=2)
    # at the launcher, from the config, before any process starts
    sets = [a for o in TINY for a in ("--set", o)]
    assert run.main(_nodes_args(tmp_path, *sets, "--set", "parallel.ep_size=4")) == 2
    assert "an expert-parallel group would span two nodes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_rendezvous_is_hosted_by_node_0_under_one_job_id(tmp_path) -> None:
    flags = []
    for rank in (0, 1):
        args = run.parser().parse_args(_nodes_args(tmp_path)[:2] + ["--node-rank", str(rank), "--nproc", "2",
                                                                   "--master-addr", "10.1.2.3",
                                                                   "--master-port", "29611"])
        flags.append(run._rendezvous(args, tmp_path / "run"))
    assert [f for f in flags[0] if "is_host" in f] == ["--rdzv-conf=is_host=1"]
    assert [f for f in flags[1] if "is_host" in f] == ["--rdzv-conf=is_host=0"]
    assert "--rdzv-endpoint=10.1.2.3:29611" in flags[0] and "--rdzv-backend=c10d" in flags[0]
    assert [f for f in flags[0] if "is_host" not in f] == [f for f in flags[1] if "is_host" not in f]
    one = run.parser().parse_args(["--nproc", "2"])
    assert run._rendezvous(one, tmp_path / "run") == ["--standalone"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(run_dir: Path, steps: int, resume: bool, layout: tuple[str, ...]) -> None:
    port = _free_port()
    sets = [a for o in TINY + [*layout, f"train.steps={steps}"] for a in ("--set", o)]
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "dropless.train", "--nnodes", "2", "--node-rank", str(rank), "--nproc", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--run-dir", str(run_dir), *sets]
        procs.append(subprocess.Popen(cmd + (["--resume"] if resume else []), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.ep_size=2",), ("parallel.ep_size=2", "parallel.pp_size=2")],
                         ids=["ep2", "pp2xep2"])
def test_two_nodes_of_two_processes_train_and_resume(tmp_path, layout) -> None:
    """EP inside each node; with pipeline stages the pipelines cross the nodes (the (pp, edp, ep)
    mesh puts pp outermost)."""
    run_dir = tmp_path / "run"
    _two_nodes(run_dir, 20, resume=False, layout=layout)
    _two_nodes(run_dir, 24, resume=True, layout=layout)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(24))
    resumed = [r for r in rows if "resumed_from" in r]
    assert [(r["resumed_from"], r["world_size"]) for r in resumed] == [("step_000020", 4)]
