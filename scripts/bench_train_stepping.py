"""Diagnostic for docs/training_speed.md "bench train": CPU time of forward + backward of the bench train
models (small, bf16 autocast, same batch every iteration), with the optimizer stepping between
iterations (`step`) or not (`nostep`: the weights never change). dropless and transformers alternate.

    PYTHONPATH=src python scripts/bench_train_stepping.py step|nostep
"""
import os, sys, time, statistics, torch
torch.set_num_threads(1)
from dropless import cpu_alloc
cpu_alloc.keep_freed_memory()
from dropless.bench import train_step as bt
b = bt.build(bt.SHAPES["small"], torch.device("cpu"), "bf16", rows=("dropless", "hf_transformers"))
mode = sys.argv[1]
for r in range(6):
    line = [mode]
    for name, loss, opt in (("dl", b.dropless_loss, b.optimizer), ("hf", b.hf_loss, b.hf_optimizer)):
        c0 = time.process_time(); loss().backward(); fb = time.process_time() - c0
        if mode == "step": opt.step()
        opt.zero_grad(set_to_none=True)
        line.append(f"{name} fb {round(fb * 1e3)}")
    print(*line, flush=True)
