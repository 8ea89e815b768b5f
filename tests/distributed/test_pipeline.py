"""Pipeline stages (distributed/pipeline.py) against one process on the same global batch: the loss and
every gradient of every step, over 3 AdamW steps with clipping, loss-free bias updates and the
global-batch aux loss on, at pp 2 (gpipe, 1f1b, zero bubble), interleaved with 2 stages per rank,
zbv, pp 2 x edp 2 (FSDP2 inside each stage) and pp 2 x ep 2 (expert parallel inside each stage).

The one-process reference runs the model's own forward on each micro-batch, the global aux loss from
a pre-pass's counts and the bias rule from the step's counts, as the trainer does
(train/micro_batches.py, train/health.py). Every rank computes it itself (a few ms) and compares the
parameters its stages hold, by name. What may differ is fp32 association only (tolerances.PIPELINE).
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_world
from dropless.config import ParallelConfig, load_config
from dropless.distributed import pipeline as pl
from dropless.distributed.mesh import build_pipeline_meshes
from dropless.pipeline_config import PipelineSpec
from dropless.layers import balance
from dropless.model import MoEModel
from tolerances import PIPELINE, assert_close

SEED, STEPS, CLIP, LR = 7, 3, 0.5, 1e-2
B, S, CALLS = 4, 8, 2  # rows per schedule call, sequence, schedule calls per step (grad accumulation)


def _cfg(*extra: str):
    return load_config(None, [
        "train.seq_len=8", "model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.max_seq_len=16",
        "model.d_ff_dense=48", "model.n_dense_layers=1", "model.moe.num_experts=5", "model.moe.top_k=2",
        "model.moe.d_expert=16", "model.moe.router.use_expert_bias=true",
        "model.moe.balance.bias_update_rate=0.01", "model.moe.balance.global_aux_loss_coeff=0.01",
        "model.moe.balance.z_loss_coeff=0.001", *extra]).model


def _data(step: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 256, (dp * CALLS, B, S + 1), generator=g)


def _segments(step: int, dp: int) -> torch.Tensor:
    """Packed documents: ids non-decreasing along each row, a new document at ~1 in 4 positions."""
    g = torch.Generator().manual_seed(200 + step)
    return (torch.rand(dp * CALLS, B, S, generator=g) < 0.25).long().cumsum(-1)


_VAL = torch.randint(0, 256, (3, S + 1), generator=torch.Generator().manual_seed(99))  # 3 rows: not B


def _reference(cfg, dp: int, micro: int, packed: bool) -> list[dict]:
    """One process: every step's loss (mean CE), the clipped gradients, the biases after the step."""
    model = MoEModel(cfg, seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        chunks = [c for call in _data(step, dp) for c in call.chunk(micro)]
        segs = [sg if packed else None for call in _segments(step, dp) for sg in call.chunk(micro)]
        A = len(chunks)
        with torch.no_grad():
            counts = sum(torch.stack([s.tokens_per_expert_E.float() for s in model(c[:, :-1], segments_BS=sg).stats])
                         for c, sg in zip(chunks, segs))
        ce_sum = 0.0
        for c, sg in zip(chunks, segs):
            o = model(c[:, :-1], c[:, 1:], segments_BS=sg)
            extra = sum(balance.global_aux_loss(m.probs_mean_E, counts[i], cfg.moe.top_k, num_tokens=c[:, :-1].numel(),
                                                num_terms=A) for i, m in enumerate(o.moe))
            ((o.loss + cfg.moe.balance.global_aux_loss_coeff * extra) / A).backward()
            ce_sum += float(o.ce_loss) / A
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        for i, layer in enumerate(model.moe_layers()):  # the training forwards' counts are the pre-pass's
            layer.router.set_bias(balance.bias_update(layer.router.expert_bias, counts[i], 0.01))
        with torch.no_grad():
            val = float(model(_VAL[:, :-1], _VAL[:, 1:]).ce_loss)
        out.append({"ce": ce_sum, "norm": float(norm), "grads": grads, "val": val,
                    "bias": {f"blocks.{j}": b.ffn.router.expert_bias.clone()
                             for j, b in enumerate(model.blocks) if b.is_moe}})
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank: int, world: int, spec: PipelineSpec, ep: int, extra: tuple[str, ...]) -> None:
    packed = "packed" in extra
    cfg = _cfg(*(e for e in extra if e != "packed"))
    dp = world // spec.pp_size
    ref = _reference(cfg, dp, spec.microbatches, packed)
    meshes = build_pipeline_meshes(spec.pp_size, ep, "cpu")
    with torch.device("meta"):
        meta = MoEModel(cfg)
    pipe = pl.Pipeline(meta, spec, meshes, ParallelConfig(ep_size=ep), torch.device("cpu"), B, S, SEED,
                       packed=packed)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    d = meshes.stage.dp.get_local_rank()
    for step in range(STEPS):
        calls = _data(step, dp)[d * CALLS:(d + 1) * CALLS]
        segs = _segments(step, dp)[d * CALLS:(d + 1) * CALLS]
        out = pipe.step([(c[:, :-1], c[:, 1:], sg) if packed else (c[:, :-1], c[:, 1:]) for c, sg in zip(calls, segs)])
        norm = pipe.clip_grad_norm_(CLIP)
        r = ref[step]
        assert abs(float(norm) - r["norm"]) <= PIPELINE.rtol * r["norm"], (step, float(norm), r["norm"])
        if out.ce is not None:
            ce = out.ce.clone()
            torch.distributed.all_reduce(ce, group=meshes.stage.dp_group)
            assert abs(float(ce) / dp - r["ce"]) <= PIPELINE.rtol * r["ce"], (step, float(ce) / dp, r["ce"])
        j = meshes.stage.mesh.get_local_rank(1)  # this rank's ep slice of each expert tensor
        for name, p in pipe.named_parameters():
            want = r["grads"][name]
            if name in pipe.expert_names:
                n = want.shape[0] // ep
                want = want[j * n:(j + 1) * n]
            assert_close(_full(p.grad), want, PIPELINE, f"rank {rank} step {step} grad {name}")
        opt.step()
        opt.zero_grad()
        counts = out.counts_LE
        layers = [(n, b) for m in pipe.modules for n, b in m.blocks.items() if b.is_moe]
        for i, (n, b) in enumerate(layers):
            b.ffn.router.set_bias(balance.bias_update(b.ffn.router.expert_bias, counts[i], 0.01))
            assert_close(b.ffn.router.expert_bias, r["bias"][f"blocks.{n}"], PIPELINE, f"step {step} bias {n}")
        val, _ = pipe.forward_only(_VAL[:, :-1], _VAL[:, 1:])  # every rank of the pipeline gets it
        assert abs(float(val) - r["val"]) <= PIPELINE.rtol * r["val"], (step, float(val), r["val"])


CASES = {  # world, spec, ep_size, overrides
    "pp2-1f1b": (2, PipelineSpec(2, "1f1b", 2), 1, ()),
    "pp2-gpipe-untied": (2, PipelineSpec(2, "gpipe", 4), 1, ("model.tie_embeddings=false",)),
    "pp2-zero_bubble": (2, PipelineSpec(2, "zero_bubble", 2), 1, ()),
    "pp2-interleaved": (2, PipelineSpec(2, "interleaved_1f1b", 2, stages_per_rank=2), 1, ()),
    "pp2-zbv": (2, PipelineSpec(2, "zbv", 2, stages_per_rank=2), 1, ()),
    "pp2xedp2": (4, PipelineSpec(2, "1f1b", 2), 1, ()),
    "pp2xep2": (4, PipelineSpec(2, "1f1b", 2), 2, ("model.moe.num_experts=4",)),
    "pp2-interleaved-packed": (2, PipelineSpec(2, "interleaved_1f1b", 2, stages_per_rank=2), 1, ("packed",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_one_process(tmp_path, case):
    world, spec, ep, extra = CASES[case]
    run_world(_worker, world, tmp_path, spec, ep, extra)
