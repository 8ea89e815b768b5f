"""train.device and train.dtype: the decision (device.py) with the hardware queries faked, the
trainer and the CLI refusing CUDA that is not there, the run log saying what was picked and why,
and the process group following the trainer's device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dropless.config import TrainConfig
from dropless import device as D
from tiny_run import tiny

AMX_CPU = {"amx_bf16": True, "amx_tile": True, "avx512_bf16": True}
AVX512_CPU = {"amx_bf16": False, "amx_tile": False, "avx512_bf16": True}
CPU = torch.device("cpu")


def fake_cpu(monkeypatch: pytest.MonkeyPatch, caps: dict | None, flags: set[str] | None) -> None:
    monkeypatch.setattr(D, "_torch_cpu_capabilities", lambda: caps)
    monkeypatch.setattr(D, "_proc_cpuinfo_flags", lambda: flags)


@pytest.mark.parametrize("caps, flags, env, want", [
    (AMX_CPU, {"amx_bf16", "avx512_bf16"}, {}, "bf16"),  # AMX machine: bf16
    (AVX512_CPU, {"avx512_bf16"}, {}, "fp32"),  # AVX-512-BF16 without AMX: fp32 is twice as fast
    (AMX_CPU, {"avx512_bf16"}, {}, "fp32"),  # the CPU has it, the kernel does not enable it
    (AMX_CPU, {"amx_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "fp32"),  # user forced no AMX
    (AMX_CPU, {"amx_bf16"}, {"DNNL_MAX_CPU_ISA": "avx2"}, "fp32"),  # the older name, any case
    (AMX_CPU, {"amx_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "bf16"),  # a cap that keeps AMX
    (AMX_CPU, {"amx_bf16"}, {"ONEDNN_MAX_CPU_ISA": "DEFAULT"}, "bf16"),
    (None, {"amx_bf16"}, {}, "bf16"),  # a torch without get_capabilities: /proc/cpuinfo decides
    (None, None, {}, "fp32"),  # nothing to ask: the safe choice
])
def test_auto_dtype_on_cpu(caps, flags, env, want, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, caps, flags)
    dtype, why = D.resolve_dtype("auto", CPU, env)
    assert dtype == want, why
    assert why.startswith("auto: ")


def test_explicit_dtype_and_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, AVX512_CPU, {"avx512_bf16"})
    assert D.resolve_dtype("bf16", CPU) == ("bf16", "train.dtype='bf16'")  # asked for: kept
    fake_cpu(monkeypatch, AMX_CPU, {"amx_bf16"})
    assert D.resolve_dtype("fp32", CPU)[0] == "fp32"
    assert D.resolve_dtype("auto", torch.device("cuda", 0)) == ("bf16", "auto: CUDA")
    assert D.resolve_dtype("auto", torch.device("meta"))[0] == "fp32"  # no autocast there
    with pytest.raises(ValueError, match="train.dtype='bf16'"):
        D.resolve_dtype("bf16", torch.device("meta"))


# The decision as a table written out by hand: (torch's capabilities, /proc/cpuinfo flags, environment,
# device) -> (dtype, the part of the reason that says why). Each row is a case the module note names.
AMX_FLAGS, NO_AMX_FLAGS = {"amx_bf16", "amx_tile", "avx512_bf16"}, {"avx512_bf16", "avx512f"}
DECISIONS = [
    # CUDA decides alone: the CPU answers are not consulted
    (AVX512_CPU, NO_AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "cuda", "bf16", "auto: CUDA"),
    (AMX_CPU, AMX_FLAGS, {}, "cpu", "bf16", "auto: CPU with AMX-BF16"),
    (AVX512_CPU, NO_AMX_FLAGS, {}, "cpu", "fp32", "CPU without AMX-BF16"),
    (AVX512_CPU, AMX_FLAGS, {}, "cpu", "fp32", "CPU without AMX-BF16"),  # torch's CPUID answer wins
    (AMX_CPU, NO_AMX_FLAGS, {}, "cpu", "fp32", "no amx_bf16 in /proc/cpuinfo"),  # kernel without AMX
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "cpu", "fp32",
     "capped below AMX (MAX_CPU_ISA=AVX512_CORE_BF16)"),
    (AMX_CPU, AMX_FLAGS, {"DNNL_MAX_CPU_ISA": "avx2"}, "cpu", "fp32", "MAX_CPU_ISA=AVX2"),  # older name
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "cpu", "bf16", "CPU with AMX-BF16"),
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": " avx10_1_512_amx "}, "cpu", "bf16", "CPU with AMX-BF16"),
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "default"}, "cpu", "bf16", "CPU with AMX-BF16"),
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "ALL"}, "cpu", "bf16", "CPU with AMX-BF16"),
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": ""}, "cpu", "bf16", "CPU with AMX-BF16"),  # set, empty
    # ONEDNN_ wins over DNNL_ when both are set, either way round
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "DNNL_MAX_CPU_ISA": "AVX2"}, "cpu",
     "bf16", "CPU with AMX-BF16"),
    (AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX512_CORE_AMX"}, "cpu",
     "fp32", "MAX_CPU_ISA=AVX2"),
    (AMX_CPU, AMX_FLAGS, {"OTHER_ISA": "AVX2"}, "cpu", "bf16", "CPU with AMX-BF16"),  # unrelated variable
    (None, AMX_FLAGS, {}, "cpu", "bf16", "CPU with AMX-BF16"),  # a torch without get_capabilities
    (None, NO_AMX_FLAGS, {}, "cpu", "fp32", "no amx_bf16 in /proc/cpuinfo"),
    (AMX_CPU, None, {}, "cpu", "bf16", "CPU with AMX-BF16"),  # no /proc/cpuinfo (not Linux)
    (AMX_CPU, None, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "cpu", "fp32", "MAX_CPU_ISA=AVX512_CORE"),
    (None, None, {}, "cpu", "fp32", "no CPU capability query available"),  # nothing to ask: fp32
    (AMX_CPU, AMX_FLAGS, {}, "meta", "fp32", "no autocast on meta"),
]


@pytest.mark.parametrize("caps, flags, env, device, dtype, reason", DECISIONS)
def test_auto_dtype_decision_table(caps, flags, env, device, dtype, reason) -> None:
    got, why = D.auto_dtype(device, caps, flags, env)
    assert (got, reason in why) == (dtype, True), why
    assert why.startswith("auto: ")


def test_resolve_dtype_reads_the_live_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live probe is a thin wrapper: what it reads goes into the table's function unchanged, and
    the environment defaults to os.environ."""
    fake_cpu(monkeypatch, AMX_CPU, AMX_FLAGS)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert D.resolve_dtype("auto", CPU) == D.auto_dtype("cpu", AMX_CPU, AMX_FLAGS, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert D.resolve_dtype("auto", CPU) == ("bf16", "auto: CPU with AMX-BF16")


def test_device_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.resolve_device("auto") == (CPU, "auto: no CUDA")
    assert D.resolve_device("cpu")[0] == CPU
    with pytest.raises(ValueError, match="train.device='cuda': CUDA is not available"):
        D.resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # auto inside a gloo group stays on the CPU even where CUDA exists (gloo cannot all-to-all CUDA)
    assert D.resolve_device("auto", backend="gloo")[0] == CPU
    with pytest.raises(ValueError, match="gloo cannot carry CUDA"):
        D.resolve_device("cuda", backend="gloo")
    with pytest.raises(ValueError, match="nccl cannot carry CPU"):
        D.resolve_device("cpu", backend="nccl")
    assert D.resolve_device("cpu", backend="cpu:gloo,cuda:nccl")[0] == CPU


def test_device_and_dtype_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="train.device"):
        TrainConfig(device="tpu")
    with pytest.raises(ValueError, match="train.dtype"):
        TrainConfig(dtype="fp16")
    assert (TrainConfig().device, TrainConfig().dtype) == ("auto", "auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_anything_is_written(tmp_path: Path, capsys) -> None:
    from dropless.train.loop import Trainer
    from dropless.train.run import main as train_main

    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="train.device='cuda'"):
        Trainer(tiny("train.device=cuda"), run_dir)
    assert not run_dir.exists()
    assert train_main(["--set", "train.device=cuda", "--run-dir", str(run_dir)]) == 2
    assert "train.device='cuda'" in capsys.readouterr().err
    assert not run_dir.exists()


def test_run_log_says_device_and_dtype(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from dropless.train.loop import Trainer

    fake_cpu(monkeypatch, AVX512_CPU, {"avx512_bf16"})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    trainer = Trainer(tiny("train.steps=2", "train.device=cpu"), tmp_path)
    assert trainer.layout.device == CPU and trainer.layout.placement.dtype == "fp32"
    summary = trainer.fit()
    out = capsys.readouterr().out
    assert "device cpu (train.device='cpu'); dtype fp32 (auto: CPU without AMX-BF16" in out
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and first["device"] == "cpu" and first["dtype"] == "fp32"
    assert "without AMX" in first["dtype_reason"]
    assert summary["device"] == "cpu" and summary["dtype"] == "fp32"
    assert json.loads((tmp_path / "summary.json").read_text())["dtype"] == "fp32"


def test_process_group_follows_the_trainers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU run on a machine with CUDA gets gloo, and no GPU is touched (it used to pick NCCL and
    # set a CUDA device whenever CUDA existed).
    import torch.distributed as dist

    from dropless.distributed.mesh import init_distributed

    backends = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("a CPU run set a CUDA device"))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: backends.append(backend))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed(CPU) is True
    assert backends == ["gloo"]


def test_batches_follow_the_device() -> None:
    from dropless.data.batches import eval_batches, get_batch

    tokens = torch.arange(1000, dtype=torch.int32) % 256
    x, y = get_batch(tokens, 3, 0, 4, 16, seed=0, device=torch.device("meta"))
    assert x.device.type == "meta" and y.device.type == "meta" and x.shape == (4, 16)
    x_cpu, y_cpu = get_batch(tokens, 3, 0, 4, 16, seed=0)
    assert x_cpu.device == CPU and torch.equal(get_batch(tokens, 3, 0, 4, 16, seed=0, device=CPU)[0], x_cpu)
    assert all(b.device.type == "meta" for b, _ in eval_batches(tokens, 4, 16, 2, device=torch.device("meta")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_layer_refuses_cuda_without_cuda(capsys) -> None:
    from dropless.bench import layer as bench

    assert bench.main(["--shape", "tiny", "--device", "cuda"]) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


def test_bench_layer_builds_every_variant_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # meta: every variant's inputs and parameters land on the requested device (the setup's routing
    # statistics are read from the host copy of the ids). The transformers baseline compares its
    # output on the host, so it stays out.
    from dropless.bench import hf_baseline
    from dropless.bench import layer as bench

    monkeypatch.setattr(hf_baseline, "available", lambda: False)
    variants, meta = bench.build_variants("tiny", "balanced", torch.bfloat16, device=torch.device("meta"))
    assert meta["device"] == "meta" and "dropless" in variants
