"""The lean experts' backward re-gather: gather then cast against cast then gather (ops/lean_experts.py), in turns,
median ms at T = 4096, D = 256 (1 thread), and whether the two give equal bf16 rows.
    PYTHONPATH=src python scripts/steptune/mb_regather.py   (docs/training_speed.md "Where a CPU training step goes")"""
import torch, time
from dropless.ops.lean_experts import regather, RowSource
torch.set_num_threads(1)
T, D, R = 4096, 256, 8192 + 256
x = torch.randn(T, D); src = torch.randint(0, T + 1, (R,))
s = RowSource(x, src, True)
res = {"gather then cast": [], "cast then gather": []}
for it in range(20):
    for k in (list(res) if it % 2 == 0 else list(res)[::-1]):
        t = time.perf_counter()
        y = regather(s).to(torch.bfloat16) if k == "gather then cast" else regather(s, torch.bfloat16)
        res[k].append(time.perf_counter() - t)
print("equal:", torch.equal(regather(s).to(torch.bfloat16), regather(s, torch.bfloat16)))
for k, v in res.items():
    v = sorted(v[2:]); print(k, "median ms", round(1e3 * v[len(v) // 2], 2))
