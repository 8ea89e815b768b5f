"""The `train` section of the configuration tree (config.py's design note applies): optimizer,
schedule, device and dtype, compile modes, checkpoints, and the LoRA sub-section."""

from __future__ import annotations

from dataclasses import dataclass, field

from .configtree import _choice, _fail, _positive, from_dict
from .lora_config import LoRAConfig

SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("auto", "bf16", "fp32")  # "auto": bf16 on CUDA and AMX CPUs, else fp32 (device.py)
DEVICES = ("auto", "cpu", "cuda")  # "auto": CUDA when present
OPTIMIZERS = ("adamw", "adamw_bf16", "muon")
COMPILE_MODES = ("off", "blocks", "step")
COMPILE_ALIASES = {"true": "blocks", "false": "off", "1": "blocks", "0": "off"}


@dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 16  # sequences per micro-batch
    seq_len: int = 256
    grad_accum: int = 1  # micro-batches per optimizer step
    optimizer: str = "adamw"  # "adamw_bf16": moments in bf16 (train/optim_lowp.py); "muon": train/muon.py
    # Muon's Newton-Schulz iteration (train/muon.py): "fp32", "bf16", or "auto" = the forward's
    # autocast dtype (bf16 on CUDA and AMX CPUs, where its GEMMs run 3-4x faster; fp32 elsewhere).
    # "auto" by default: on three seeds the bf16 iteration ended no worse than fp32 (docs/optimizers.md)
    muon_ns_dtype: str = "auto"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # WSD: share of steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    # Steps with a non-finite loss or gradient norm are skipped (train/nonfinite.py); this many in a
    # row stop the run: five different batches failing on unchanged weights is no passing glitch.
    max_nonfinite_steps: int = 5
    seed: int = 1337
    # Where and in what precision (device.py decides "auto" and logs why): device "auto" is CUDA
    # when present; dtype is the forward's autocast dtype, "auto" = bf16 on CUDA and on CPUs with AMX,
    # fp32 elsewhere (a bf16 matmul without AMX runs at about half the fp32 speed). Master weights,
    # optimizer state and the router stay fp32 either way.
    device: str = "auto"
    dtype: str = "auto"
    deterministic: bool = True
    eval_every: int = 100
    eval_batches: int = 16
    ckpt_every: int = 200
    keep_last: int = 2
    threads: int = 0  # torch intra-op threads (0 = torch's default)
    # torch.compile (train/compiling.py; falls back to eager with one warning where the backend cannot
    # compile; the first steps pay the compile): "off"; "blocks" each transformer block (fullgraph, in
    # place); "step" the whole step: the model's forward with its loss (one graph, its backward built
    # with it) and the gradient norm and optimizer update (graphs of their own). true / false read as
    # "blocks" / "off".
    compile: str = "off"
    # what builds the compiled graphs: "inductor" (kernels) or "aot_eager" (the same graphs traced,
    # run with the eager kernels: a quick check that a configuration compiles without a graph break)
    compile_backend: str = "inductor"
    # CUDA graphs: replay the compiled step's kernels as captured graphs (train.compile = "step", CUDA
    # only; inductor's "reduce-overhead" mode)
    cuda_graphs: bool = False
    # low-rank adapters on a frozen base (lora_config.py; off with rank 0)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = from_dict(LoRAConfig, self.lora, "train.lora.")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches",
                     "ckpt_every", "keep_last", "max_nonfinite_steps"):
            _positive(f"train.{name}", getattr(self, name))
        _choice("train.optimizer", self.optimizer, OPTIMIZERS)
        # a bool from an older config.toml or `--set train.compile=true` (read as a string)
        self.compile = COMPILE_ALIASES.get(str(self.compile).lower(), self.compile)
        _choice("train.compile", self.compile, COMPILE_MODES)
        _choice("train.compile_backend", self.compile_backend, ("inductor", "aot_eager"))
        if self.cuda_graphs and self.compile != "step":
            raise ValueError(f"train.cuda_graphs=true: captures the compiled step, so it needs "
                             f"train.compile=step (got {self.compile!r})")
        _choice("train.muon_ns_dtype", self.muon_ns_dtype, ("auto", "fp32", "bf16"))
        _choice("train.schedule", self.schedule, SCHEDULES)
        _choice("train.dtype", self.dtype, DTYPES)
        _choice("train.device", self.device, DEVICES)
        if not self.lr > 0:
            _fail("train.lr", self.lr, "must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail("train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if not 0 < self.decay_fraction <= 1:
            _fail("train.decay_fraction", self.decay_fraction, "must be in (0, 1]")
        if not 0 <= self.warmup_steps <= self.steps:
            _fail("train.warmup_steps", self.warmup_steps, f"must be in [0, train.steps={self.steps}]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"train.{name}", getattr(self, name), "must be in [0, 1)")
        for name in ("weight_decay", "grad_clip", "threads"):
            if getattr(self, name) < 0:
                _fail(f"train.{name}", getattr(self, name), "must be >= 0")
