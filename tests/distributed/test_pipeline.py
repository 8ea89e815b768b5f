"""Pipeline stages (distributed/pipeline.py) against one process on the same global batch: the loss and
every gradient of every step, over 3 AdamW steps with clipping, loss-free bias updates and the
global-batch aux loss on, at pp 2 (gpipe, 1f1b, zero bubble), interleaved with 2 stages per rank,
zbv, pp 2 x edp 2 (FSDP2 inside each stage) and pp 2 x ep 2 (expert parallel inside each stage);
then the model knobs that need more than hidden states between stages: multi-token prediction (the
modules on the last stage, with the embedding's copy there whether the head is tied or not; dense
and MoE blocks), hash routing (the token ids at every stage), both at once on zbv (the first and the
last stage on one rank), and the parallel MoE block.

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
    """One process: every step's loss (mean CE; the MTP modules' mean loss), the clipped gradients,
    the biases after the step (the MTP modules' MoE blocks from the training forwards' counts: the
    pre-pass runs no MTP, model.py)."""
    model = MoEModel(cfg, seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rate = cfg.moe.balance.bias_update_rate
    out = []
    for step in range(STEPS):
        chunks = [c for call in _data(step, dp) for c in call.chunk(micro)]
        segs = [sg if packed else None for call in _segments(step, dp) for sg in call.chunk(micro)]
        A = len(chunks)
        with torch.no_grad():
            counts = sum(torch.stack([s.tokens_per_expert_E.float() for s in model(c[:, :-1], segments_BS=sg).stats])
                         for c, sg in zip(chunks, segs))
        ce_sum = mtp_sum = 0.0
        mtp_counts = 0
        for c, sg in zip(chunks, segs):
            o = model(c[:, :-1], c[:, 1:], segments_BS=sg)
            extra = sum(balance.global_aux_loss(m.probs_mean_E, counts[i], cfg.moe.top_k, num_tokens=c[:, :-1].numel(),
                                                num_terms=A) for i, m in enumerate(o.moe))
            ((o.loss + cfg.moe.balance.global_aux_loss_coeff * extra) / A).backward()
            ce_sum += float(o.ce_loss) / A
            if o.mtp_loss is not None:
                mtp_sum += float(o.mtp_loss) / A
            if o.mtp_moe:
                mtp_counts = mtp_counts + torch.stack([m.stats.tokens_per_expert_E.float() for m in o.mtp_moe])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if cfg.moe.router.use_expert_bias:
            for i, layer in enumerate(model.moe_layers()):  # the training forwards' counts are the pre-pass's
                layer.router.set_bias(balance.bias_update(layer.router.expert_bias, counts[i], rate))
            for i, layer in enumerate(model.mtp_moe_layers()):
                layer.router.set_bias(balance.bias_update(layer.router.expert_bias, mtp_counts[i], rate))
        with torch.no_grad():
            val = float(model(_VAL[:, :-1], _VAL[:, 1:]).ce_loss)
        out.append({"ce": ce_sum, "mtp": mtp_sum, "norm": float(norm), "grads": grads, "val": val,
                    "bias": {n: b.ffn.router.expert_bias.clone() for n, b in _moe_blocks(model.named_children())
                             if cfg.moe.router.use_expert_bias}})
    return out


def _moe_blocks(children) -> list[tuple[str, torch.nn.Module]]:  # noqa: ANN001
    """(name in the model, block) of every MoE block among `children` (an MoEModel's or a stage's
    named_children()): the main blocks, then the MTP modules' blocks (`mtp.<k>`)."""
    kids = dict(children)
    main = [(f"blocks.{n}", b) for n, b in (kids["blocks"].items() if isinstance(kids["blocks"], torch.nn.ModuleDict)
                                            else enumerate(kids["blocks"])) if b.is_moe]
    mtp = [(f"mtp.{k}", m.block) for k, m in enumerate(kids.get("mtp") or []) if m.block.is_moe]
    return main + mtp


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
        assert (out.mtp is not None) == (pipe.has_last and cfg.mtp_depth > 0), step
        if out.mtp is not None:
            mtp = out.mtp.clone()
            torch.distributed.all_reduce(mtp, group=meshes.stage.dp_group)
            assert abs(float(mtp) / dp - r["mtp"]) <= PIPELINE.rtol * r["mtp"], (step, float(mtp) / dp, r["mtp"])
        j = meshes.stage.mesh.get_local_rank(1)  # this rank's ep slice of each expert tensor
        for name, p in pipe.named_parameters():
            want = r["grads"][name]
            if name in pipe.expert_names:
                n = want.shape[0] // ep
                want = want[j * n:(j + 1) * n]
            assert_close(_full(p.grad), want, PIPELINE, f"rank {rank} step {step} grad {name}")
        opt.step()
        opt.zero_grad()
        counts = out.counts_LE  # this rank's main layers, then its MTP modules' MoE blocks
        blocks = [nb for m in pipe.modules for nb in _moe_blocks(m.named_children()) if nb[0].startswith("blocks.")]
        blocks += [nb for m in pipe.modules for nb in _moe_blocks(m.named_children()) if nb[0].startswith("mtp.")]
        assert len(counts) == len(blocks), (len(counts), [n for n, _ in blocks])
        rate = cfg.moe.balance.bias_update_rate
        for i, (n, b) in enumerate(blocks if cfg.moe.router.use_expert_bias else []):
            b.ffn.router.set_bias(balance.bias_update(b.ffn.router.expert_bias, counts[i], rate))
            assert_close(b.ffn.router.expert_bias, r["bias"][n], PIPELINE, f"step {step} bias {n}")
        val, _ = pipe.forward_only(_VAL[:, :-1], _VAL[:, 1:])  # every rank of the pipeline gets it
        assert abs(float(val) - r["val"]) <= PIPELINE.rtol * r["val"], (step, float(val), r["val"])


MTP_MOE = ("model.mtp_depth=1", "model.mtp_block=moe", "model.moe.balance.global_aux_loss_coeff=0",
           "model.moe.balance.seq_aux_loss_coeff=0.001")
HASH = ("model.moe.router.strategy=hash", "model.moe.router.use_expert_bias=false",
        "model.moe.balance.bias_update_rate=0")

CASES = {  # world, spec, ep_size, overrides
    "pp2-1f1b": (2, PipelineSpec(2, "1f1b", 2), 1, ()),
    "pp2-gpipe-untied": (2, PipelineSpec(2, "gpipe", 4), 1, ("model.tie_embeddings=false",)),
    "pp2-zero_bubble": (2, PipelineSpec(2, "zero_bubble", 2), 1, ()),
    "pp2-interleaved": (2, PipelineSpec(2, "interleaved_1f1b", 2, stages_per_rank=2), 1, ()),
    "pp2-zbv": (2, PipelineSpec(2, "zbv", 2, stages_per_rank=2), 1, ()),
    "pp2xedp2": (4, PipelineSpec(2, "1f1b", 2), 1, ()),
    "pp2xep2": (4, PipelineSpec(2, "1f1b", 2), 2, ("model.moe.num_experts=4",)),
    "pp2-interleaved-packed": (2, PipelineSpec(2, "interleaved_1f1b", 2, stages_per_rank=2), 1, ("packed",)),
    # multi-token prediction: the modules on the last stage, the token ids and targets sent to it, the
    # embedding's copy there summed with the first stage's. An MoE block (DeepSeek-V3's) is balanced
    # by the micro-batch and sequence aux losses and the bias (config: not with the global aux loss)
    "pp2-1f1b-mtp-moe": (2, PipelineSpec(2, "1f1b", 2), 1, MTP_MOE),
    # untied: the last stage holds the embedding for the MTP modules alone; depth 2 with dense blocks,
    # the global aux loss's pre-pass (no MTP in it), 4 micro-batches
    "pp2-gpipe-untied-mtp2": (2, PipelineSpec(2, "gpipe", 4), 1, ("model.tie_embeddings=false", "model.mtp_depth=2",
                                                                   "model.mtp_weight=0.5")),
    # ids, document ids and targets carried together through 4 stages; module k's documents
    "pp2-interleaved-packed-mtp": (2, PipelineSpec(2, "interleaved_1f1b", 2, stages_per_rank=2), 1,
                                   ("packed", "model.mtp_depth=1")),
    "pp2xedp2-mtp-moe": (4, PipelineSpec(2, "1f1b", 2), 1, MTP_MOE),  # FSDP2 over the MTP modules (the root)
    # hash routing: every stage's MoE layers route by the token ids (4 MoE layers: n_dense_layers=0)
    "pp2-1f1b-hash": (2, PipelineSpec(2, "1f1b", 2), 1, (*HASH, "model.n_dense_layers=0")),
    # zbv: the first and the last stage on rank 0 (the embedding one module, nothing to sum), the ids
    # through rank 1's middle stages; the MTP block routes by the shifted tokens' ids
    "pp2-zbv-hash-mtp-moe-untied": (2, PipelineSpec(2, "zbv", 2, stages_per_rank=2), 1,
                                    (*HASH, *MTP_MOE, "model.tie_embeddings=false")),
    # the parallel (ScMoE) block: the MoE reads the block input
    "pp2-1f1b-parallel": (2, PipelineSpec(2, "1f1b", 2), 1, ("model.block=parallel_moe",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_one_process(tmp_path, case):
    world, spec, ep, extra = CASES[case]
    run_world(_worker, world, tmp_path, spec, ep, extra)
