"""Step time of the tiny preset: AdamW vs Muon (fp32 NS) vs Muon (bf16 NS), timed in turns in one process."""
import sys, time, statistics, tempfile, torch
from dropless.config import load_config
from dropless.train.loop import Trainer
from dropless.train.run import preset_path
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
common = ["log.progress=false", "log.plots=false", "log.tensorboard=false", f"train.threads={torch.get_num_threads()}"]
variants = {"adamw": ["train.optimizer=adamw", "train.lr=3e-3"],
            "muon_fp32ns": ["train.optimizer=muon", "train.lr=1e-2", "train.muon_ns_dtype=fp32"],
            "muon_bf16ns": ["train.optimizer=muon", "train.lr=1e-2", "train.muon_ns_dtype=bf16"]}
tr = {k: Trainer(load_config(preset_path("tiny"), common + v), tempfile.mkdtemp()) for k, v in variants.items()}
times = {k: [] for k in tr}
for k in tr:
    for s in range(3): tr[k].train_step(s)
for rnd in range(8):
    for k, t in tr.items():
        t0 = time.perf_counter(); t.train_step(3 + rnd); times[k].append(time.perf_counter() - t0)
for k, v in times.items(): print(k, f"median {statistics.median(v)*1e3:.0f} ms", [round(x * 1e3) for x in v])
m = {k: statistics.median(v) for k, v in times.items()}
print("muon_fp32ns/adamw", round(m["muon_fp32ns"] / m["adamw"], 3), "muon_bf16ns/adamw", round(m["muon_bf16ns"] / m["adamw"], 3))
