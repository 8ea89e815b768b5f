"""The training step's profile split by op category (torch.profiler self CPU time, 4 steps after 6).

    PYTHONPATH=<tree>/src python scripts/steptune/profile_train_step.py PRESET [a.b=v ...]
"""
import sys
import tempfile

from dropless.config import load_config
from dropless.train.loop import Trainer
from torch.profiler import profile, ProfilerActivity
sets = ["train.threads=1", "log.progress=false", "log.plots=false"] + sys.argv[2:]
tr = Trainer(load_config(sys.argv[1], sets), tempfile.mkdtemp())
print(tr.layout.placement.describe())
for s in range(6):
    tr.train_step(s, log_step=False)
N = 4
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for s in range(10, 10 + N):
        tr.train_step(s, log_step=(s == 10 + N - 1))
cats = {"GEMM (mm, grouped_mm, addmm)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm"),
        "attention kernel (SDPA flash fwd+bwd)": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
        "dtype casts (copy_)": ("aten::copy_",),
        "gathers/concats (index_select, embedding_bag, cat)": ("aten::index_select", "aten::_embedding_bag_forward_only", "aten::_embedding_bag", "aten::cat", "aten::embedding_dense_backward", "aten::index_add_"),
        "optimizer + clip (_fused_adamw_, norms)": ("aten::_fused_adamw_", "aten::_foreach_norm", "aten::linalg_vector_norm", "aten::_foreach_mul_", "aten::_foreach_mul"),
        "loss (log_softmax fwd+bwd)": ("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward", "aten::nll_loss_backward")}
tot = 0; split = {k: 0.0 for k in cats}; split["other (element-wise, reductions, allocations, Python)"] = 0.0
for e in prof.key_averages():
    t = e.self_cpu_time_total; tot += t
    for k, names in cats.items():
        if e.key in names:
            split[k] += t; break
    else:
        split["other (element-wise, reductions, allocations, Python)"] += t
print(f"profiled CPU time per step: {tot / N / 1e3:.0f} ms")
for k, v in split.items():
    print(f"| {k} | {v / N / 1e3:.0f} ms | {100 * v / tot:.0f}% |")
