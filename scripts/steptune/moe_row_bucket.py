"""The MoE layer at the default preset's shape (T=4096, d=256, E=8, k=2, f=256), forward + backward
under CPU bf16 autocast, with expert groups unpadded vs rounded up to 32 and 128 rows, in turns.

    PYTHONPATH=src python scripts/steptune/moe_row_bucket.py [THREADS]

ops/grouped_gemm.py `row_bucket` says why (oneDNN builds one kernel per GEMM shape).
"""

import sys
import time

import torch

from dropless.layers.moe import MoELayer
from dropless.moe_config import MoEConfig
from dropless.ops import grouped_gemm

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
layer = MoELayer(256, MoEConfig(num_experts=8, top_k=2, d_expert=256))
res: dict[int, list[float]] = {1: [], 32: [], 128: []}
for it in range(12):
    x = torch.randn(4096, 256, requires_grad=True)  # new routing every iteration: new group sizes
    for bucket in (list(res) if it % 2 == 0 else list(res)[::-1]):
        grouped_gemm.CPU_LOWP_ROW_BUCKET = bucket
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.y.float().pow(2).mean().backward()
        res[bucket].append(time.perf_counter() - t)
for bucket, v in res.items():
    v = sorted(v[2:])
    print(f"groups rounded to {bucket} rows: median {1e3 * v[len(v) // 2]:.1f} ms")
