"""Diagnostic for docs/benchmarks.md "bench train": CPU time (process_time, --threads 1) of the whole
bench train models, dropless vs transformers, bf16 autocast: the forward alone (no_grad), forward +
backward, and the optimizer step + zero_grad, interleaved rounds.

    PYTHONPATH=src python scripts/bench_train_whole.py small 4     # shape, rounds
"""
import sys, time, statistics, torch
torch.set_num_threads(1)
from dropless.bench import train_step as bt
shape = bt.SHAPES[sys.argv[1]]
b = bt.build(shape, torch.device("cpu"), "bf16", rows=("dropless", "hf_transformers"))
def fb_dl():
    b.dropless_loss().backward()
def fb_hf():
    b.hf_loss().backward()
def opt_dl():
    b.optimizer.step(); b.optimizer.zero_grad(set_to_none=True)
def opt_hf():
    b.hf_optimizer.step(); b.hf_optimizer.zero_grad()
def fwd_dl():
    with torch.no_grad(): b.dropless_loss()
def fwd_hf():
    with torch.no_grad(): b.hf_loss()
fns = {"fwd_dl": fwd_dl, "fwd_hf": fwd_hf, "fb_dl": fb_dl, "opt_dl": opt_dl, "fb_hf": fb_hf, "opt_hf": opt_hf}
for f in fns.values(): f()
res = {n: [] for n in fns}
for r in range(int(sys.argv[2])):
    for n, f in fns.items():
        c0 = time.process_time(); f(); res[n].append(time.process_time() - c0)
for n, v in res.items():
    print(f"{n:8s} cpu ms median {statistics.median(v)*1e3:8.1f}  all {[round(t*1e3) for t in v]}", flush=True)
