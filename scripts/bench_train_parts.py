"""Diagnostic for docs/training_speed.md "bench train": CPU time (process_time, --threads 1) of each part of the
step on its own, dropless vs transformers, same weights (bench/train_step.py's models), bf16 autocast:
one MoE layer and one attention (forward + backward of y.float().square().mean() on a random input),
the final norm + LM head + cross-entropy, and the optimizer step (grads set to zeros first).

    PYTHONPATH=src python scripts/bench_train_parts.py small bf16 5     # shape, autocast, rounds
"""
import sys, time, statistics, torch
torch.set_num_threads(1)
from dropless.bench import train_step as bt
shape = bt.SHAPES[sys.argv[1]]
dtype = sys.argv[2]
b = bt.build(shape, torch.device("cpu"), dtype, rows=("dropless", "hf_transformers"))
B, S, D = shape.batch, shape.seq_len, shape.d_model
g = torch.Generator().manual_seed(0)
x = torch.randn(B, S, D, generator=g)
dl = b.model.blocks[0]; hl = b.hf.model.layers[0]
cos, sin = b.model.rope_cos[:S], b.model.rope_sin[:S]
pe = b.hf.model.rotary_emb(x, torch.arange(S)[None])
def ac():
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)
def run(f):
    def g_():
        xi = x.clone().requires_grad_(True)
        with ac():
            y = f(xi)
        y.float().square().mean().backward()
    return g_
fns = {
 "dl_moe": run(lambda h: dl.ffn(h).y),
 "hf_moe": run(lambda h: hl.mlp(h)[0] if isinstance(hl.mlp(h), tuple) else hl.mlp(h)),
 "dl_attn": run(lambda h: dl.attn(h, cos, sin)),
 "hf_attn": run(lambda h: hl.self_attn(h, position_embeddings=pe, attention_mask=None)[0]),
}
def ce_dl():
    h = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    with ac():
        logits = b.model.head(b.model.norm(h))
    torch.nn.functional.cross_entropy(logits.float().view(B * S, -1), b.targets_BS.reshape(-1)).backward()
def ce_hf():
    h = torch.randn(B, S, D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    with ac():
        logits = b.hf.lm_head(b.hf.model.norm(h))
        loss = b.hf.loss_function(logits, b.tokens_BS, b.hf.config.vocab_size)
    loss.backward()
fns["dl_head_ce"] = ce_dl; fns["hf_head_ce"] = ce_hf
def opt_dl():
    for p in b.model.parameters(): p.grad = torch.zeros_like(p)
    c0 = time.process_time(); b.optimizer.step(); return time.process_time() - c0
def opt_hf():
    for p in b.hf.parameters(): p.grad = torch.zeros_like(p)
    c0 = time.process_time(); b.hf_optimizer.step(); return time.process_time() - c0
for f in fns.values(): f()
res = {n: [] for n in fns}; res["dl_opt"] = []; res["hf_opt"] = []
for r in range(int(sys.argv[3])):
    for n, f in fns.items():
        c0 = time.process_time(); f(); res[n].append(time.process_time() - c0)
    res["dl_opt"].append(opt_dl()); res["hf_opt"].append(opt_hf())
for n, v in res.items():
    print(f"{n:12s} cpu ms median {statistics.median(v)*1e3:8.1f}  all {[round(t*1e3) for t in v]}")
