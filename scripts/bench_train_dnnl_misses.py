"""Diagnostic for docs/training_speed.md "bench train": dropless's forward + backward CPU time per training
step on the bench's small model (bf16 autocast, the same batch, AdamW at learning rate LR), with
model.moe.align = ALIGN. Run under ONEDNN_VERBOSE=profile_create to count oneDNN's primitive
creations per step (the "=== step" lines separate the steps):

    ONEDNN_VERBOSE=profile_create PYTHONPATH=src python scripts/bench_train_dnnl_misses.py LR ALIGN 2>&1 | \\
      awk '/^=== step/{s=$3} /^=== fb/{print "step", s, "fb_ms", $3, "miss", m[s]+0, "hit", h[s]+0} /cache_miss/{m[s]++} /cache_hit/{h[s]++}'
"""
import sys
import time

import torch

from dropless import cpu_alloc
from dropless.bench import train_step as bt

torch.set_num_threads(1)
cpu_alloc.keep_freed_memory()
lr, align = float(sys.argv[1]), int(sys.argv[2])
b = bt.build(bt.SHAPES["small"], torch.device("cpu"), "bf16", rows=("dropless",), align=align)
for g in b.optimizer.param_groups:
    g["lr"] = lr
for r in range(6):
    print(f"=== step {r}", flush=True)
    c0 = time.process_time()
    b.dropless_loss().backward()
    fb = time.process_time() - c0
    b.optimizer.step()
    b.optimizer.zero_grad(set_to_none=True)
    print(f"=== fb {round(fb * 1e3)}", flush=True)
