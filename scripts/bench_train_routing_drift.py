"""Diagnostic for docs/training_speed.md "bench train": dropless's forward + backward CPU time per training
step on the bench's small model (same batch, AdamW stepping), each step's cross-entropy and each MoE
layer's largest expert load / mean load; `ftz` sets torch.set_flush_denormal(True) first.

    PYTHONPATH=src python scripts/bench_train_routing_drift.py plain|ftz
"""
import os, sys, time, statistics, torch
torch.set_num_threads(1)
from dropless import cpu_alloc
cpu_alloc.keep_freed_memory()
if sys.argv[1] == "ftz": torch.set_flush_denormal(True)
from dropless.bench import train_step as bt
b = bt.build(bt.SHAPES["small"], torch.device("cpu"), "bf16", rows=("dropless",))
for r in range(6):
    c0 = time.process_time()
    with b.autocast():
        out = b.model(b.tokens_BS, b.targets_BS)
    out.loss.backward(); fb = time.process_time() - c0
    b.optimizer.step(); b.optimizer.zero_grad(set_to_none=True)
    vio = [round(float(s.tokens_per_expert_E.max() / s.tokens_per_expert_E.float().mean()), 2) for s in out.stats]
    print(sys.argv[1], "fb", round(fb * 1e3), "loss", round(float(out.ce_loss), 3), "max/mean load", vio, flush=True)
