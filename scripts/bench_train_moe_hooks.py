"""Diagnostic for docs/training_speed.md "bench train": CPU time of dropless's MoE layers inside the whole
model's forward + backward (forward hooks for the forward; tensor hooks on the layer's output and input
gradients bracket its backward) against one layer alone, small shape, bf16 autocast, no optimizer.

    PYTHONPATH=src python scripts/bench_train_moe_hooks.py
"""
import time, statistics, torch, collections
torch.set_num_threads(1)
from dropless import cpu_alloc
cpu_alloc.keep_freed_memory()
from dropless.bench import train_step as bt
from dropless.layers.moe import MoELayer
shape = bt.SHAPES["small"]
b = bt.build(shape, torch.device("cpu"), "bf16", rows=("dropless",))
acc = collections.defaultdict(float); t = {}
def pre(mod, args):
    t[("f", id(mod))] = time.process_time()
    h = args[0]
    if h.requires_grad:
        h.register_hook(lambda g, m=id(mod): acc.__setitem__("bwd", acc["bwd"] + time.process_time() - t[("b", m)]))
def post(mod, args, out):
    acc["fwd"] += time.process_time() - t[("f", id(mod))]
    if out.y.requires_grad:
        out.y.register_hook(lambda g, m=id(mod): (t.__setitem__(("b", m), time.process_time()), print(m % 1000, g.dtype, g.shape, g.stride(), g.is_contiguous()) if first else None)[0])
for m in b.model.modules():
    if isinstance(m, MoELayer):
        m.register_forward_pre_hook(pre); m.register_forward_hook(post)
first = True
B, S, D = shape.batch, shape.seq_len, shape.d_model
x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(0))
layer = b.model.blocks[0].ffn
for r in range(4):
    acc.clear()
    c0 = time.process_time(); b.dropless_loss().backward(); tot = time.process_time() - c0
    first = False
    print("model", round(tot * 1e3), {k: round(v * 1e3) for k, v in acc.items()}, flush=True)
    b.model.zero_grad(set_to_none=True)
    acc.clear()
    xi = x.clone().requires_grad_(True)
    c0 = time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xi).y
    y.float().square().mean().backward()
    print("alone", round((time.process_time() - c0) * 1e3), {k: round(v * 1e3) for k, v in acc.items()}, flush=True)
    b.model.zero_grad(set_to_none=True)
