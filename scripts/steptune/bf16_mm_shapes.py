"""bf16 (oneDNN) vs fp32 (MKL) CPU matmuls, [M, 256] @ [256, 512], 60 calls: M random in 900-1100,
M fixed at 1000, M random rounded up to 32. oneDNN creates a kernel per new shape.

    python scripts/steptune/bf16_mm_shapes.py
"""

import random
import time

import torch

torch.set_num_threads(1)
random.seed(0)
X = torch.randn(1200, 256)
W = torch.randn(256, 512)


def gflops(ms: list[int], dtype: torch.dtype) -> float:
    x, w = X.to(dtype), W.to(dtype)
    t = time.perf_counter()
    for m in ms:
        x[:m] @ w
    return sum(2 * m * 256 * 512 for m in ms) / (time.perf_counter() - t) / 1e9


for r in range(2):
    row = {}
    for dn, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        row[f"{dn} random"] = gflops([random.randint(900, 1100) for _ in range(60)], dtype)
        row[f"{dn} fixed"] = gflops([1000] * 60, dtype)
        row[f"{dn} rounded to 32"] = gflops([(random.randint(900, 1100) + 31) // 32 * 32 for _ in range(60)], dtype)
    print("GFLOP/s", {k: round(v, 1) for k, v in row.items()})
