"""One side of `dropless bench lora` (bench/lora.py), run in a process of its own.

Legend: B batch, S sequence, V vocabulary, E experts, D model width, F expert width, r rank, P the
probed positions.

    python -m dropless.bench.lora_side dropless|peft SPEC.json OUT.json

Each side builds its adapted model from the checkpoint folder, draws the same batch (`batch`: B x S+1
token ids from `seed`, inputs the first S, targets the last S), and runs `warmup` untimed then
`steps` timed optimizer steps: forward, cross-entropy (fp32 logits, mean over the B S targets: the
same expression on both sides, so neither library's loss wrapper is in the comparison), backward,
`torch.optim.AdamW(trainable, lr)`, `zero_grad(set_to_none=True)`. The optimizer is the same class
with the same settings on both sides (dropless's trainer would use train/optim.py): the comparison
is of the models' forward and backward, not of two optimizers.

The dropless side (this file): `MoEModel(cfg, lora=...)` built on the meta device, materialised and
filled from the checkpoint by name (hf/import_hf.py's loader: the adapters are not in the checkpoint
and keep no value), then the adapters initialised by their own rules (layers/init.py: A uniform,
B zero), then every B redrawn N(0, B_STD^2) so that each adapter's product enters the loss, and
the adapters saved for the peft side. The peft side (bench/lora_peft.py) copies them into its own
layout before its first step, so the first step of the two sides is the same function.

The first step is also the equivalence check (`Built.first_step`, called with the step's logits of
the first sequence's first P positions and with the adapters' gradients in place, before the
optimizer moves anything): the dropless side saves both to the work folder, the peft side compares
its own with them. After it, both sides move apart by design: peft holds q, k and v's A as three
tensors that AdamW moves separately, dropless one shared A.

Time per step: wall, and this process's CPU seconds (user + system, all threads; the system part
alone as `sys_s_per_step`), medians over the timed steps.

Memory, from /proc/self/status: `rss_loaded` is VmRSS once the model, its adapters and the optimizer
exist (before the first step); `train_peak` is VmHWM over the steps after the first (reset to the
current VmRSS once the first step, which carries the checks and allocates AdamW's state, is done:
writing 5 to /proc/self/clear_refs, bench/load_memory.py); `load_peak` is VmHWM just before that
reset (imports, load and the first step); `process_peak` the larger of the two, the lifetime peak.
(Not `ru_maxrss`: in a live process Linux answers it from the same high-water mark the reset
lowers, so after a reset it is no longer the lifetime peak.) The last
warm-up step runs under torch.profiler to name the grouped-GEMM ops that ran (which experts kernel
each library used).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import load_memory as mem

from .lora_common import (ADAPTERS, B_NAMES, B_STD, GRADS, LOGITS, PROBE, Built, Spec, autocast,  # noqa: F401
                          batch, cross_entropy)


def build_dropless(spec: Spec) -> Built:
    from ..hf import import_hf
    from ..layers import init, lora
    from ..lora_config import LoRAConfig
    from ..model import MoEModel

    cfg, _ = import_hf.checkpoint_config(spec.hf_dir)
    lcfg = LoRAConfig(rank=spec.rank, alpha=spec.alpha, targets=["attn", "experts"])
    with torch.device("meta"):
        model = MoEModel(cfg, lora=lcfg)
    model.materialize("cpu")
    with torch.no_grad():
        import_hf.weight_loader(spec.hf_dir)(model)
        rules = init.collect_rules(model)
        adapters = {n: p for n, p in model.named_parameters() if lora.is_adapter(n)}
        for name, p in adapters.items():
            rule = init.normal(B_STD) if name.rsplit(".", 1)[-1] in B_NAMES else rules[name]
            init.fill_(init.whole(name, p), rule, spec.seed, name)
    torch.save({n: p.detach() for n, p in adapters.items()}, spec.path(ADAPTERS))
    model.train()
    tokens_BS, targets_BS = batch(cfg.vocab_size, spec.batch, spec.seq, spec.seed)

    def loss(want_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the trainer's call (train/micro_batches.py: a LoRA run's loss in chunks, no logits), or, for the
        # first step's check, the plain call that returns the logits (the same loss up to fp32 reordering)
        with autocast(spec.dtype):
            out = model(tokens_BS, targets_BS, loss_only=not want_logits)
        return out.ce_loss, out.logits  # ce_loss: the same expression as `cross_entropy`

    def first_step(logits_PV: torch.Tensor) -> dict:
        torch.save(logits_PV, spec.path(LOGITS))
        torch.save({n: p.grad for n, p in adapters.items()}, spec.path(GRADS))
        return {}

    experts = model.moe_layers()[0].experts
    info = {"vocab": cfg.vocab_size, "experts_backend": experts.backend, "n_layers": cfg.n_layers,
            "d_model": cfg.d_model, "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
            "d_expert": cfg.moe.d_expert}
    return Built(loss, [p for p in model.parameters() if p.requires_grad], info, first_step)


def grouped_ops(step: Callable[[], float]) -> tuple[float, dict[str, int]]:
    """Run `step` under the profiler: its loss and the ops it ran whose name holds "grouped_mm"."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        value = step()
    return value, {e.key: e.count for e in prof.key_averages() if "grouped_mm" in e.key}


def measure(side: str, spec: Spec) -> dict:
    torch.set_num_threads(spec.threads)
    start = time.perf_counter()
    if side == "dropless":
        built = build_dropless(spec)
    else:
        from . import lora_peft

        built = lora_peft.build(spec)
    optimizer = torch.optim.AdamW(built.trainable, lr=spec.lr)
    load_s = time.perf_counter() - start
    rss_loaded = mem.vm_bytes("VmRSS")
    first: dict = {}

    def step(check: bool = False) -> float:
        loss, logits_BSV = built.loss(check)
        probe_PV = logits_BSV[0, :PROBE].detach().float().clone() if check else None
        del logits_BSV
        loss.backward()
        if check:
            first.update(built.first_step(probe_PV))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(check=True)]
    before = mem.vm_bytes("VmHWM")  # the load's and the first step's peak, which the reset forgets
    peak_reset = mem.reset_peak()
    ops: dict[str, int] = {}
    for i in range(1, spec.warmup):
        if i == spec.warmup - 1:
            value, ops = grouped_ops(step)
            losses.append(value)
        else:
            losses.append(step())
    wall, cpu, kernel = [], [], []
    for _ in range(spec.steps):
        t0, w0 = os.times(), time.perf_counter()
        losses.append(step())
        t1 = os.times()
        wall.append(time.perf_counter() - w0)
        cpu.append(t1.user + t1.system - t0.user - t0.system)
        kernel.append(t1.system - t0.system)  # page faults and zeroing of fresh allocations, mostly
    train_peak = mem.vm_bytes("VmHWM")  # read once: a second read can be a page higher than the first
    out = {"side": side, "load_s": load_s, "rss_loaded": rss_loaded, "train_peak": train_peak,
           "peak_reset": peak_reset, "load_peak": before, "process_peak": max(before, train_peak),
           "losses": losses, "s_per_step": statistics.median(wall), "cpu_s_per_step": statistics.median(cpu),
           "sys_s_per_step": statistics.median(kernel), "step_s": wall, "cpu_step_s": cpu,
           "tokens_per_s": spec.batch * spec.seq / statistics.median(wall), "grouped_ops": ops,
           "trainable": sum(p.numel() for p in built.trainable), "threads": torch.get_num_threads(),
           "first_step": first, **built.info}
    if built.check is not None:  # after the figures above: a check's memory is not the step's
        out["delta_check"] = built.check()
    return out


def main(argv: list[str]) -> int:
    side, spec_path, out_path = argv
    if side not in ("dropless", "peft"):
        raise ValueError(f"side={side!r}: must be dropless or peft")
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    if spec.malloc == "keep":
        from ..cpu_alloc import keep_freed_memory

        keep_freed_memory()  # before the model's first tensor, as the `dropless` command does
    result = measure(side, spec)
    Path(out_path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
