"""The peft side of `dropless bench lora`: transformers' Qwen3-MoE with peft's LoRA on the same targets.

Legend: E experts, D model width, F expert width, I / O a projection's input / output width, r rank,
s = alpha / r.

The model: `Qwen3MoeForCausalLM.from_pretrained(DIR, dtype=float32)`, its experts implementation left
to transformers (5.x resolves an unset one to "grouped_mm", `get_correct_experts_implementation`;
which kernel ran is read back by the profiler, bench/lora_side.py), SDPA attention, no KV cache. The
adapters: `peft.LoraConfig(r, lora_alpha, target_modules=[q_proj, k_proj, v_proj, o_proj],
target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj])`. peft wraps the two 3-D expert
parameters in `ParamWrapper`s, which fold the update into the weight on every forward
(`baddbmm(W, lhs, rhs, alpha=s)`, a new [E, 2F, D] and [E, D, F] per layer) and differentiate
through it: that is the cost this benchmark measures against dropless's grouped adapters.

The same adapters in peft's layout (the dropless side saved its own, bench/lora_side.py):
- q_proj, k_proj, v_proj: dropless adapts the fused q|k|v with one A, so each of peft's three gets
  that A and its own rows of B (the rows hf/mapping.py maps each projection's weight to): the same
  update, B_q A, B_k A, B_v A. o_proj: A and B as they are.
- the experts, dropless a [E, I, r] and b [E, r, O] (per expert x @ a @ b * s): peft's
  lora_A.weight is [r E, I] whose row block e is a_e^T, lora_B.weight is [O, r E] whose column
  j E + e is b_e[j, :] (`ParamWrapper.get_delta_weight` reads them that way for a parameter stored
  [E, O, I]). `expert_A`, `expert_B` write that layout and `expert_a`, `expert_b` read it back;
  `delta_check` compares peft's own get_delta_weight with (a_e b_e s)^T for every expert, after
  the timed steps.
The first step's gradients, peft's mapped back to dropless's adapters (`dropless_grads`): the layouts
are linear maps, so a gradient maps as its parameter does, except that dropless's shared q|k|v A
receives the sum of the three A gradients peft computes.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from ..hf import import_hf, mapping
from ..hf.optional import require
from ..hf.peft_export import experts_A as expert_A, experts_B as expert_B  # the export's layout
from .lora_common import ADAPTERS, GRADS, LOGITS, Built, Spec, autocast, batch, cross_entropy

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = {"gate_up_proj": ("lora_a1_EDr", "lora_b1_ErW"), "down_proj": ("lora_a2_EFr", "lora_b2_ErD")}
# peft's get_delta_weight (an einsum) against a bmm of the same fp32 factors: each element is the
# same r products summed in another order, a few ulps of the element (REFERENCE fp32's argument)
DELTA_RTOL = 1e-5


def _libs() -> tuple[Any, Any]:
    need = "dropless bench lora"
    return require("transformers", need), require("peft", need)


def expert_a(A: torch.Tensor, E: int) -> torch.Tensor:
    """The inverse of expert_A: peft's [r E, I] -> dropless [E, I, r] (a view)."""
    return A.reshape(E, -1, A.shape[1]).transpose(1, 2)


def expert_b(B: torch.Tensor, E: int) -> torch.Tensor:
    """The inverse of expert_B: peft's [O, r E] -> dropless [E, r, O] (a view)."""
    return B.reshape(B.shape[0], -1, E).permute(2, 1, 0)


def _param_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's ParamWrappers by the HF name of the parameter each adapts ("model.layers.0.mlp.experts.
    gate_up_proj"); nested wrappers (two parameters of one module) are named by their own parameter."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            owner = name.removeprefix("base_model.model.").replace(".base_layer", "")
            out[f"{owner}.{module.parameter_name}"] = module
    return out


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    """peft's adapted Linears by the HF module name ("model.layers.0.self_attn.q_proj")."""
    from peft.tuners.lora.layer import Linear

    return {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if isinstance(m, Linear)}


@torch.no_grad()
def copy_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], cfg: Any) -> int:
    """Write dropless's adapters (by its parameter names) into the peft model (module note); returns
    how many peft tensors were written. A peft adapter with no dropless counterpart is a ValueError."""
    slots = {s.hf_name: s for s in mapping.slots(mapping.meta_model(cfg), "qwen3_moe")}
    fused = {s.hf_name: s for s in mapping.fused_slots(mapping.meta_model(cfg), "qwen3_moe")}
    written = 0
    for name, layer in _linears(model).items():
        slot = slots[name + ".weight"]
        owner = slot.param.rsplit(".", 1)[0]  # blocks.i.attn.qkv / blocks.i.attn.out
        A, B = adapters[owner + ".lora_A"], adapters[owner + ".lora_B"]
        layer.lora_A["default"].weight.copy_(A)
        layer.lora_B["default"].weight.copy_(B[slot.index] if slot.index else B)
        written += 2
    for name, wrapper in _param_wrappers(model).items():
        owner = fused[name].param.rsplit(".", 1)[0]  # blocks.i.ffn.experts
        a_name, b_name = EXPERTS[wrapper.parameter_name]
        wrapper.lora_A["default"].weight.copy_(expert_A(adapters[f"{owner}.{a_name}"]))
        wrapper.lora_B["default"].weight.copy_(expert_B(adapters[f"{owner}.{b_name}"]))
        written += 2
    expected = sum(1 for n, p in model.named_parameters() if p.requires_grad)
    if written != expected:
        raise ValueError(f"wrote {written} peft adapter tensors of {expected}: a target without a counterpart")
    return written


def build(spec: Spec) -> Built:
    transformers, peft = _libs()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec.hf_dir, dtype=torch.float32)
    model.config.use_cache = False
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                             target_modules=list(ATTN),
                             target_parameters=[f"mlp.experts.{p}" for p in EXPERTS])
    model = peft.get_peft_model(model, config)
    cfg, _ = import_hf.checkpoint_config(spec.hf_dir)
    adapters = torch.load(spec.path(ADAPTERS), map_location="cpu", weights_only=True, mmap=True)
    copy_adapters(model, adapters, cfg)
    del adapters  # (not held through the steps: the checks read the files again)
    model.train()
    vocab = model.config.vocab_size
    tokens_BS, targets_BS = batch(vocab, spec.batch, spec.seq, spec.seed)

    def loss(want_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # (transformers returns them always)
        with autocast(spec.dtype):
            logits_BSV = model(input_ids=tokens_BS, use_cache=False).logits
            return cross_entropy(logits_BSV, targets_BS), logits_BSV

    info = {"vocab": vocab, "experts_implementation": model.config._experts_implementation,
            "attn_implementation": model.config._attn_implementation,
            "transformers": transformers.__version__, "peft": peft.__version__}
    return Built(loss, [p for p in model.parameters() if p.requires_grad], info,
                 first_step=lambda logits_PV: first_step_check(model, cfg, spec, logits_PV),
                 check=lambda: delta_check(model, spec))


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |theirs - ours| / max |ours| (0 when both are zero)."""
    scale = ours.abs().max().item()
    return (theirs - ours).abs().max().item() / scale if scale else float((theirs != ours).any())


def dropless_grads(model: nn.Module, cfg: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """peft's adapter gradients as the gradients of dropless's adapters, by dropless name: a shared
    A's is the sum of the A gradients of the projections that share it (q, k, v), a fused B's the
    row blocks of theirs in row order, an expert adapter's the inverse of expert_A / expert_B. One
    tensor at a time (each a fresh [E, I, r] at most)."""
    slots = {s.hf_name: s for s in mapping.slots(mapping.meta_model(cfg), "qwen3_moe")}
    fused = {s.hf_name: s for s in mapping.fused_slots(mapping.meta_model(cfg), "qwen3_moe")}
    owners: dict[str, list[tuple[int, nn.Module]]] = {}
    for name, layer in _linears(model).items():
        slot = slots[name + ".weight"]
        start = slot.index[0].start if slot.index else 0
        owners.setdefault(slot.param.rsplit(".", 1)[0], []).append((start, layer))
    for owner, parts in owners.items():
        parts.sort(key=lambda p: p[0])
        yield owner + ".lora_A", sum(layer.lora_A["default"].weight.grad for _, layer in parts)
        yield owner + ".lora_B", torch.cat([layer.lora_B["default"].weight.grad for _, layer in parts])
    for name, wrapper in _param_wrappers(model).items():
        owner = fused[name].param.rsplit(".", 1)[0]
        a_name, b_name = EXPERTS[wrapper.parameter_name]
        E = wrapper.num_experts
        yield f"{owner}.{a_name}", expert_a(wrapper.lora_A["default"].weight.grad, E)
        yield f"{owner}.{b_name}", expert_b(wrapper.lora_B["default"].weight.grad, E)


def first_step_check(model: nn.Module, cfg: Any, spec: Spec, logits_PV: torch.Tensor) -> dict:
    """The first step's probed logits and every adapter gradient against the dropless side's."""
    ours_PV = torch.load(spec.path(LOGITS), weights_only=True)
    grads = torch.load(spec.path(GRADS), map_location="cpu", weights_only=True, mmap=True)
    worst, worst_name, seen = 0.0, "", set()
    for name, g in dropless_grads(model, cfg):
        rel = _rel(grads[name], g)
        seen.add(name)
        if rel >= worst:
            worst, worst_name = rel, name
    if seen != set(grads):
        raise ValueError(f"gradients compared for {len(seen)} dropless adapters of {len(grads)}: "
                         f"missing {sorted(set(grads) - seen)[:4]}")
    return {"logits_rel_diff": _rel(ours_PV, logits_PV), "grad_rel_diff": worst, "grad_worst": worst_name,
            "grads_compared": len(seen)}


@torch.no_grad()
def delta_check(model: nn.Module, spec: Spec) -> dict:
    """peft's get_delta_weight of every expert parameter against dropless's per-expert (a b s)^T, with
    the initial adapters written again (the steps moved peft's), one parameter at a time."""
    adapters = torch.load(spec.path(ADAPTERS), map_location="cpu", weights_only=True, mmap=True)
    cfg, _ = import_hf.checkpoint_config(spec.hf_dir)
    copy_adapters(model, adapters, cfg)
    fused = {s.hf_name: s for s in mapping.fused_slots(mapping.meta_model(cfg), "qwen3_moe")}
    worst = 0.0
    for name, wrapper in _param_wrappers(model).items():
        owner = fused[name].param.rsplit(".", 1)[0]
        a_name, b_name = EXPERTS[wrapper.parameter_name]
        ours_EOI = (torch.bmm(adapters[f"{owner}.{a_name}"], adapters[f"{owner}.{b_name}"])
                    * (spec.alpha / spec.rank)).transpose(1, 2)
        theirs_EOI = wrapper.get_delta_weight("default")
        if theirs_EOI.shape != ours_EOI.shape:
            raise ValueError(f"{name}: peft's delta is {tuple(theirs_EOI.shape)}, dropless's "
                             f"{tuple(ours_EOI.shape)}")
        worst = max(worst, ((theirs_EOI - ours_EOI).abs().max() / ours_EOI.abs().max()).item())
        del ours_EOI, theirs_EOI
    return {"params": len(_param_wrappers(model)), "max_rel_diff": worst, "rtol": DELTA_RTOL,
            "passed": worst <= DELTA_RTOL}
