"""The four expert GEMMs of one MoE layer (forward: x @ w1, a @ w2; backward: dgrad, wgrad), bmm over
groups padded to the largest against torch's grouped_mm over the ragged (32-row aligned) groups, for
one group 0, 25, 50 and 100% above the mean (ops/grouped_gemm.py `uniform_limit`).

    python scripts/steptune/uniform_bmm.py [bf16|fp32]

E 16, D 256, F 256 (SwiGLU: 2F = 512), 8192 rows (the tiny preset's 4096 tokens x top-2), at 2 then 1
threads; each figure the sum of the four products' mean times over 40 calls after 5 warm-up calls.
"""

from __future__ import annotations

import sys
import time

import torch

E, D, F2, P = 16, 256, 512, 8192


def timed(f, n: int = 40) -> float:
    for _ in range(5):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w1, w2 = torch.randn(E, D, F2, dtype=dtype), torch.randn(E, F2 // 2, D, dtype=dtype)
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for above in (0.0, 0.25, 0.5, 1.0):
            big = int(P / E * (1 + above))
            rest = (P - big) // (E - 1)
            counts = [big] + [rest] * (E - 1)
            counts[-1] += P - sum(counts)
            aligned = [(c + 31) // 32 * 32 for c in counts]
            R, C = sum(aligned), max(aligned)
            offs = torch.tensor(aligned).cumsum(0).to(torch.int32)
            x, g, a = (torch.randn(R, n, dtype=dtype) for n in (D, F2, F2 // 2))
            xc, gc, ac = (torch.randn(E, C, n, dtype=dtype) for n in (D, F2, F2 // 2))
            grouped = (timed(lambda: torch._grouped_mm(x, w1, offs=offs))
                       + timed(lambda: torch._grouped_mm(a, w2, offs=offs))
                       + timed(lambda: torch._grouped_mm(g, w1.transpose(-2, -1), offs=offs))
                       + timed(lambda: torch._grouped_mm(x.t(), g, offs=offs)))
            bmm = (timed(lambda: torch.bmm(xc, w1)) + timed(lambda: torch.bmm(ac, w2))
                   + timed(lambda: torch.bmm(gc, w1.transpose(-2, -1)))
                   + timed(lambda: torch.bmm(xc.transpose(1, 2), gc)))
            print(f"threads {threads}  rows E*C / aligned {E * C / R:.2f}  grouped_mm {grouped:.2f} ms  "
                  f"bmm {bmm:.2f} ms  bmm / grouped_mm {bmm / grouped:.2f}", flush=True)


if __name__ == "__main__":
    main(torch.float32 if sys.argv[1:] == ["fp32"] else torch.bfloat16)
