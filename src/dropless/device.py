"""Where the trainer computes and in which dtype: one decision at start, with its reason.

`train.device`:
- "auto": CUDA when torch sees a GPU, else the CPU. Inside an already initialised process group the
  group's backend decides (NCCL -> CUDA, gloo -> CPU), so the tensors fit the collectives.
- "cpu", "cuda": as asked; "cuda" without CUDA is a ValueError naming the field.
Under torchrun a CUDA process uses GPU `LOCAL_RANK` (one GPU per process).

`train.dtype` is the autocast dtype of the forward (master weights, optimizer state and the router
stay fp32 whatever it is):
- "auto": bf16 on CUDA and on CPUs whose matmul library can use AMX, fp32 elsewhere.
- "bf16", "fp32": as asked.
Why not bf16 on every CPU: without AMX a bf16 matmul runs on AVX-512-BF16 dot products (or is
emulated), at about half the fp32 speed, because MKL's fp32 GEMM is the better kernel there. Measured
(2048x1024 @ 1024x1024, 2 threads): a Xeon with AVX-512 but no AMX, bf16 166 vs fp32 308 GFLOP/s
; a Xeon with AMX, bf16 2338 vs fp32 343 GFLOP/s, and bf16 196 vs fp32 330 once AMX is
disabled for oneDNN (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`; fp32 goes through MKL). At the model level
the gap is smaller: the default preset trains 1.4-1.8x faster in fp32 without AMX, and with AMX bf16
trains faster than fp32 (docs/training_speed.md "The CPU dtype"); `train.dtype=fp32` overrides.

AMX detection, all three must agree:
1. the CPU has AMX-BF16: torch's own query `torch.cpu.get_capabilities()["amx_bf16"]` (cpuinfo,
   i.e. CPUID; torch builds without it fall back to step 2 alone);
2. the OS enabled it: Linux lists `amx_bf16` in /proc/cpuinfo only when the kernel manages the AMX
   tile state (checked where that file exists);
3. oneDNN, which runs torch's bf16 CPU matmuls, may use it: `ONEDNN_MAX_CPU_ISA` (or the older
   `DNNL_MAX_CPU_ISA`) unset, DEFAULT, or an ISA that includes AMX (`AVX512_CORE_AMX`,
   `AVX10_1_512_AMX`, ...). A cap below AMX is how a user forces the non-AMX path.
torch's other queries do not answer this: `torch.backends.cpu.get_cpu_capability()` names ATen's
vector ISA ("AVX512"), the same on CPUs with and without AMX, and ignores oneDNN's cap, as does
`get_capabilities()` (measured: both unchanged under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16).
The decision is `auto_dtype`, a pure function of the device type and the three answers (capability
dict, /proc/cpuinfo flags, environment); `resolve_dtype` reads the live ones and passes them in.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Mapping

import torch

_AUTOCAST = {"bf16": torch.bfloat16, "fp32": None}
_ONEDNN_UNCAPPED = ("", "DEFAULT", "ALL")


@dataclass(frozen=True)
class Placement:
    """The device and autocast dtype of a run, and why they were picked (said in the run log)."""

    device: torch.device
    dtype: str  # "bf16" | "fp32"
    device_reason: str
    dtype_reason: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST[self.dtype]

    def autocast(self) -> ContextManager:
        """The forward's autocast context: bf16 autocast on the device, or nothing for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        return f"device {self.device} ({self.device_reason}); dtype {self.dtype} ({self.dtype_reason})"

    def as_dict(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": self.dtype, "device_reason": self.device_reason,
                "dtype_reason": self.dtype_reason}


def _proc_cpuinfo_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU flags Linux reports, or None where there is no such file."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _torch_cpu_capabilities() -> dict | None:
    get = getattr(torch.cpu, "get_capabilities", None)
    return dict(get()) if get is not None else None


def onednn_isa_cap(env: Mapping[str, str] | None = None) -> str | None:
    """The ISA cap oneDNN was given (ONEDNN_MAX_CPU_ISA, else DNNL_MAX_CPU_ISA), upper case; None
    when neither is set."""
    env = os.environ if env is None else env
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if name in env:
            return env[name].strip().upper()
    return None


def amx_bf16_decision(caps: Mapping[str, bool] | None, flags: set[str] | None,
                      env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether bf16 CPU matmuls run on AMX tiles, and why (module note), from the three answers:
    torch's capability query `caps` (None: this torch has none), the /proc/cpuinfo `flags` (None:
    no such file) and the environment `env` holding oneDNN's ISA cap. A pure function."""
    if caps is None and flags is None:
        return False, "no CPU capability query available"
    if caps is not None and not caps.get("amx_bf16", False):
        return False, "CPU without AMX-BF16 (torch.cpu.get_capabilities)"
    if flags is not None and "amx_bf16" not in flags:
        return False, "no amx_bf16 in /proc/cpuinfo (CPU or kernel without AMX)"
    cap = onednn_isa_cap(env)
    if cap is not None and cap not in _ONEDNN_UNCAPPED and "AMX" not in cap:
        return False, f"AMX-BF16 CPU, but oneDNN is capped below AMX (MAX_CPU_ISA={cap})"
    return True, "CPU with AMX-BF16"


def auto_dtype(device_type: str, caps: Mapping[str, bool] | None, flags: set[str] | None,
               env: Mapping[str, str]) -> tuple[str, str]:
    """`train.dtype=auto` on a device of `device_type`: ("bf16" | "fp32", reason), a pure function of
    the CPU answers `amx_bf16_decision` takes (read on the CPU only)."""
    if device_type == "cuda":
        return "bf16", "auto: CUDA"
    if device_type == "cpu":
        amx, why = amx_bf16_decision(caps, flags, env)
        return ("bf16" if amx else "fp32"), f"auto: {why}"
    return "fp32", f"auto: no autocast on {device_type}"


def resolve_device(name: str, backend: str | None = None) -> tuple[torch.device, str]:
    """`train.device` -> (device, reason). `backend`: an initialised process group's backend
    (gloo carries CPU tensors, NCCL CUDA tensors; "cpu:gloo,cuda:nccl" both)."""
    has_cuda = torch.cuda.is_available()
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device={name!r}: must be one of auto, cpu, cuda")
    if name == "cuda" and not has_cuda:
        raise ValueError(f"train.device={name!r}: CUDA is not available to this torch "
                         f"({torch.__version__}); use 'cpu' or 'auto'")
    group_cuda = backend is not None and "nccl" in backend
    if name == "auto" and backend is not None:
        use_cuda, reason = group_cuda and has_cuda, f"auto: the process group's backend is {backend}"
    elif name == "auto":
        use_cuda, reason = has_cuda, "auto: CUDA available" if has_cuda else "auto: no CUDA"
    else:
        use_cuda, reason = name == "cuda", f"train.device={name!r}"
    if backend is not None and use_cuda != group_cuda and ("gloo" not in backend or use_cuda):
        raise ValueError(f"train.device={name!r}: the process group's backend {backend} cannot carry "
                         f"{'CUDA' if use_cuda else 'CPU'} tensors (NCCL for CUDA, gloo for CPU)")
    if not use_cuda:
        return torch.device("cpu"), reason
    local_rank = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"train.device={name!r}: LOCAL_RANK={local_rank} but {torch.cuda.device_count()} "
                         "GPU(s) visible; launch one process per GPU")
    return torch.device("cuda", local_rank), reason


def resolve_dtype(name: str, device: torch.device, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """`train.dtype` -> ("bf16" | "fp32", reason) for `device` (module note); "auto" is `auto_dtype`
    on this machine's live answers (`env`: default os.environ)."""
    if name in ("bf16", "fp32"):
        if name == "bf16" and not torch.amp.is_autocast_available(device.type):
            raise ValueError(f"train.dtype={name!r}: torch has no autocast on device {device.type!r}")
        return name, f"train.dtype={name!r}"
    if name != "auto":
        raise ValueError(f"train.dtype={name!r}: must be one of auto, bf16, fp32")
    if device.type != "cpu":  # the CPU queries are not read where they decide nothing
        return auto_dtype(device.type, None, None, {})
    return auto_dtype("cpu", _torch_cpu_capabilities(), _proc_cpuinfo_flags(), os.environ if env is None else env)


def resolve(device: str | torch.device, dtype: str, backend: str | None = None,
            env: dict[str, str] | None = None) -> Placement:
    """The run's placement from `train.device` (or a torch.device, taken as given: tests use
    "meta") and `train.dtype`."""
    if isinstance(device, torch.device):
        dev, dev_why = device, "given by the caller"
    else:
        dev, dev_why = resolve_device(device, backend)
    dt, dt_why = resolve_dtype(dtype, dev, env)
    return Placement(dev, dt, dev_why, dt_why)


def activate(device: torch.device) -> None:
    """Make a CUDA device the current one, for whatever defaults to it (streams, generators)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def deterministic_cublas(device: torch.device) -> None:
    """cuBLAS is deterministic only with a fixed workspace; torch refuses deterministic mode on CUDA
    without it. Set before the first cuBLAS call (a value the user set is kept)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def deterministic(device: torch.device) -> None:
    """`train.deterministic`: deterministic kernels (cuBLAS with its fixed workspace on CUDA).
    Deterministic mode also fills every new tensor from torch.empty with NaN, a net for code that
    reads memory it never wrote. Ours reads no such memory (GEMM tails and padding are selected
    away, never read); the fill cost 2.5% of a `tiny` step (346.5 vs 337.8 ms, interleaved). The
    test suite keeps the net (DROPLESS_FILL_UNINITIALIZED=1, set in tests/conftest.py and inherited
    by the processes tests start), so such a read would show there as NaN."""
    deterministic_cublas(device)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = (
        os.environ.get("DROPLESS_FILL_UNINITIALIZED", "0") == "1")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, asynchronously (the copy is
    ordered on the stream before any kernel that reads it, so no host wait)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
