"""`dropless export-hf RUN --out DIR --family F --adapters-only`: a LoRA run's adapters as a peft folder.

DIR gets `adapter_config.json` and `adapter_model.safetensors` and nothing else: what
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)` loads onto the
base (`base_model_name_or_path`: the folder of train.lora.base_from "hf:DIR"). The format is peft
0.21.2's with transformers 5's modules (the routed experts as fused 3-D parameters), checked against
both by tests/test_hf_peft_export.py; transformers 4.x has per-expert modules and cannot take it.

Legend: E experts, D model width, F expert width, r rank, s = alpha / r; as layers/lora.py.

What peft holds for each dropless adapter (HF names: the layer prefix model.layers.{i}.):

    dropless (blocks.{i}.)          peft                                     how
    attn.qkv  A [r, D], B rows      self_attn.q_proj / k_proj / v_proj       target_modules; the same A
              q | k | v                                                      for the three, B's rows each
    attn.out                        self_attn.o_proj                         target_modules
    MLA q_a, q_b, q_proj, kv_a,     self_attn.q_a_proj, q_b_proj, q_proj,    target_modules (whole
    kv_b, out                       kv_a_proj_with_mqa, kv_b_proj, o_proj    weights: hf/deepseek.py)
    ffn.gate_up (dense), rows       mlp.gate_proj / up_proj .weight          target_parameters; A to both
    gate | up; ffn.down             mlp.down_proj.weight
    ffn.shared.gate_up / down       mlp.shared_experts.{gate,up,down}_proj   target_parameters, as above
    ffn.experts a1 [E, D, r],       mlp.experts.gate_up_proj (the inner      target_parameters
    b1 [E, r, 2F]                   ParamWrapper: experts.base_layer.lora_*)
    ffn.experts a2 [E, F, r],       mlp.experts.down_proj (the outer one:
    b2 [E, r, D]                    experts.lora_*)
    ffn.router (trained)            mlp.gate (its weight, and DeepSeek-V3's  modules_to_save
                                    e_score_correction_bias)

Each row is one of hf/mapping.py's slots read as an adapter: a LoRALinear's A goes whole to every HF
module its weight is cut into, and B's rows follow the slot's region, so B_q A, B_k A, B_v A are
exactly the fused update's rows (layers/lora.py). The experts: peft's ParamWrapper over
transformers 5's gate_up_proj [E, 2F, D] (peft/tuners/lora/layer.py) keeps lora_A.weight
[E r, D] read as (E, r, D) and lora_B.weight [2F, r E] read as (2F, r, E), and adds
s B_e A_e to expert e; dropless adds s (a1[e] b1[e])^T there (w_gate_up_EDF[e] is gate_up_proj[e]
transposed), so A_e = a1[e]^T and B_e = b1[e]^T:
    lora_A = a1.permute(0, 2, 1).reshape(E r, D)        lora_B = b1.permute(2, 1, 0).reshape(2F, r E)
and the same for down_proj with (a2, b2). peft wraps the parameters of one module in the order the
module registers them, whatever the config lists: gate_up_proj first (inner), down_proj around it.

Why the MLPs are parameter targets. peft 0.21.2 under transformers 5 rewrites the config of an MoE
family at every load (peft/utils/transformers_weight_conversion.py, `_convert_peft_config_moe`, for
adapters trained on transformers 4): every target_modules entry ending in gate_proj, up_proj or
down_proj (Mixtral: w1, w3, w2) becomes the routed experts' fused parameter, in every layer; a
regex is first cut down to the bare names it matches, which loses its layers. So a dense MLP or a
shared expert named as a module would silently adapt the routed experts instead. As a parameter
target (the 2-D weight, a ParamWrapper with one "expert") the same update s B A lands on the weight
itself and the conversion leaves it alone. Attention modules are not renamed and stay module
targets, each by its full name, so train.lora.layers picks exactly those layers.

The router. A "router" target trains the router's weight in full: peft's modules_to_save, which
saves and restores the whole module (weight and buffers). DeepSeek-V3's router also holds the
loss-free balancing bias, which moves during a LoRA run whenever the balancing rule updates it
(model.moe.balance.bias_update_rate); a layer whose bias moved from the base's gets its router in
modules_to_save too, with the base's weight (read from the base) and the run's bias: peft restores a
module to save whole or fails on a missing key. Multi-token prediction modules are never adapted
(model.py); their bias may move, but transformers builds no MTP layers and computes the same logits.

Refused by name, before anything is written: a run that is not a LoRA run; a model the family cannot
express (mapping.check_exportable); a base of the initial weights (train.lora.base_from ""), which no
checkpoint holds for peft to load onto; train.lora.dropout with a target that peft reaches only as a
parameter target (dense, shared, experts: ParamWrapper refuses lora_dropout != 0). Every other
target of every family reaches peft. The adapters were trained on the base named by base_from:
its digest is checked as a load does (runs/lora_base.py), so the folder belongs to that base as it
is now. A base held quantised in training (train.lora.base != fp32) is exported all the same, with a
note: peft applies the adapters to the full-precision base, which differs from the one they trained
against by the quantisation error (merge-lora merges into the dequantised base instead).

The checkpoint is read one tensor at a time (runs/dcp_tensors.py), the base model never built: the
adapters are a few MB even for a large model. One safetensors file (peft reads no shards).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .. import atomic
from ..config import LoRAConfig, RunConfig
from ..layers import lora as lora_layers
from ..model import MoEModel
from ..model_lora import trainable_names, trains
from ..runs import lora_base
from ..runs.dcp_tensors import TensorSpec, check, open_tensors
from . import mapping
from .import_hf import INDEX_FILE, shard_files
from .optional import require
from .shard_load import safe_open

PEFT_VERSION = "0.21.2"  # the peft whose format this writes (module note)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's key prefix: PeftModel.base_model (LoraModel).model


@dataclass(frozen=True)
class Entry:
    """One tensor of adapter_model.safetensors: its peft key, and where it is read from."""

    key: str
    param: str  # the dropless parameter or buffer (the checkpoint's name; the base's when `base`)
    index: tuple[Any, ...] = ()  # the region of it (rows of a fused B)
    layout: str = "plain"  # "plain": as it is; "experts_A" / "experts_B": a routed-expert A / B as peft keeps it
    base: bool = False  # read from the base (a router weight that did not train), not the checkpoint


@dataclass
class Plan:
    entries: list[Entry] = field(default_factory=list)
    target_modules: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    modules_to_save: list[str] = field(default_factory=list)
    param_targets: dict[str, str] = field(default_factory=dict)  # train.lora target -> an HF name


def experts_A(a_EXr: torch.Tensor) -> torch.Tensor:
    """A routed-expert A [E, X, r] (X = D for gate|up, F for down) as peft's lora_A.weight [E r, X]."""
    E, X, r = a_EXr.shape
    return a_EXr.permute(0, 2, 1).reshape(E * r, X)


def experts_B(b_ErY: torch.Tensor) -> torch.Tensor:
    """A routed-expert B [E, r, Y] (Y = 2F or D) as peft's lora_B.weight [Y, r E] (column j E + e)."""
    E, r, Y = b_ErY.shape
    return b_ErY.permute(2, 1, 0).reshape(Y, r * E)


def _target(name: str) -> str:
    """The train.lora target a LoRALinear of the model (its name) belongs to (model_lora.py)."""
    part = name.split(".")[2]  # blocks.{i}.attn|ffn...
    if part == "attn":
        return "mla_low_rank" if name.split(".")[3] in ("q_a", "kv_a") else "attn"
    return "shared" if ".ffn.shared." in name else "dense"


def plan(model: MoEModel, lora: LoRAConfig, family: str, moved_bias: set[int] = frozenset()) -> Plan:
    """The peft tensors and config lists of adapted `model` (meta is enough) as `family` (module
    note's table); `moved_bias`: the MoE blocks whose router bias moved from the base's."""
    out = Plan()
    by_param: dict[str, list[mapping.Slot]] = defaultdict(list)
    for s in mapping.slots(model, family):
        by_param[s.param].append(s)
    fused = {s.param: s.hf_name for s in mapping.fused_slots(model, family)}
    for name, module in model.named_modules():
        if isinstance(module, lora_layers.LoRALinear):
            parameter = ".ffn." in name  # module note: the MLPs as parameter targets
            for s in by_param[f"{name}.weight"]:
                assert not s.transpose, s  # (only the routed experts are stored transposed)
                hf = s.hf_name.removesuffix(".weight")
                (out.target_parameters if parameter else out.target_modules).append(s.hf_name if parameter else hf)
                if parameter:
                    out.param_targets.setdefault(_target(name), s.hf_name)
                out.entries += [Entry(f"{PREFIX}{hf}.lora_A.weight", f"{name}.lora_A"),
                                Entry(f"{PREFIX}{hf}.lora_B.weight", f"{name}.lora_B", s.index)]
        elif lora_layers.has_expert_adapters(module):
            gate_up, down = fused[f"{name}.w_gate_up_EDF"], fused[f"{name}.w_down_EFD"]
            experts = gate_up.rsplit(".", 1)[0]  # model.layers.{i}.mlp.experts
            out.target_parameters += [gate_up, down]
            out.param_targets.setdefault("experts", gate_up)
            a1, b1, a2, b2 = (f"{name}.{n}" for n in lora_layers.EXPERT_ADAPTERS)
            out.entries += [Entry(f"{PREFIX}{experts}.base_layer.lora_A.weight", a1, layout="experts_A"),
                            Entry(f"{PREFIX}{experts}.base_layer.lora_B.weight", b1, layout="experts_B"),
                            Entry(f"{PREFIX}{experts}.lora_A.weight", a2, layout="experts_A"),
                            Entry(f"{PREFIX}{experts}.lora_B.weight", b2, layout="experts_B")]
    for i, block in enumerate(model.blocks):
        router = f"blocks.{i}.ffn.router."
        trained = trains(router + "weight", lora)
        if not block.is_moe or not (trained or i in moved_bias):
            continue
        gate = fused[f"blocks.{i}.ffn.experts.w_gate_up_EDF"].rsplit(".", 2)[0] + ".gate"  # model.layers.{i}.mlp.gate
        out.modules_to_save.append(gate)
        for s in (s for p, ss in by_param.items() if p.startswith(router) for s in ss):  # weight (and bias)
            leaf = s.hf_name.rsplit(".", 1)[1]
            from_base = s.param.endswith(".weight") and not trained  # (the bias: always the run's)
            out.entries.append(Entry(f"{PREFIX}{gate}.{leaf}", s.param, base=from_base))
    return out


def refuse(cfg: RunConfig, family: str, model: MoEModel) -> None:
    """A ValueError naming the field for what peft cannot hold (module note); nothing when it can.
    `model`: the run's model (meta is enough)."""
    lora = cfg.train.lora
    if not lora.enabled:
        raise ValueError(f"train.lora.rank={lora.rank}: not a LoRA run, no adapters to export (export-hf "
                         "without --adapters-only exports a full run)")
    mapping.check_exportable(cfg.model, family)
    if not lora.base_from:
        raise ValueError("train.lora.base_from='': the base is the initial weights of train.seed, which no "
                         "checkpoint holds for peft to load the adapters onto; merge them instead "
                         "(dropless merge-lora RUN --out RUN2, then export-hf RUN2)")
    param_targets = plan(model, lora, family).param_targets
    if lora.dropout and param_targets:
        target, hf = next(iter(param_targets.items()))
        raise ValueError(f"train.lora.dropout={lora.dropout} with {target!r} in train.lora.targets: peft "
                         f"{PEFT_VERSION} holds it under transformers 5 only as a parameter target ({hf}; "
                         "hf/peft_export.py says why), which refuses lora_dropout != 0; train with dropout 0, "
                         "or merge (dropless merge-lora) and export the full model")


def adapter_config(cfg: RunConfig, out: Plan) -> dict[str, Any]:
    """adapter_config.json: the fields peft's own save_pretrained writes that say something about
    these adapters; peft fills every other field with its default on load."""
    lora = cfg.train.lora
    base = lora_base.base_path(lora) if lora.base_from.startswith("hf:") else None

    def listed(names: list[str]) -> list[str] | None:
        return sorted(set(names)) or None

    return {"peft_type": "LORA", "peft_version": PEFT_VERSION, "task_type": "CAUSAL_LM",
            "base_model_name_or_path": None if base is None else str(base), "revision": None,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": False,
            "use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True,
            "target_modules": listed(out.target_modules), "target_parameters": listed(out.target_parameters),
            "modules_to_save": listed(out.modules_to_save), "exclude_modules": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def base_reader(lora: LoRAConfig, model: MoEModel, family: str) -> Callable[[str], torch.Tensor]:
    """Read one tensor of the base by its dropless name: from the run's latest checkpoint
    (run:DIR), or its HF tensor (hf:DIR, hf/mapping.py's name; a whole-tensor slot)."""
    path = lora_base.base_path(lora)
    assert path is not None  # (refuse() took the seed's base)
    if lora.base_from.startswith("run:"):
        base = lora_base.RunBase(path).path
        return open_tensors(base).read
    names = {s.param: s.hf_name for s in mapping.slots(model, family) if not s.index and not s.copy}
    files = shard_files(path)
    index = path / INDEX_FILE
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else {}

    def read(param: str) -> torch.Tensor:
        name = names[param]
        with safe_open()(str(path / where.get(name, files[0].name)), framework="pt") as f:
            t = f.get_tensor(name)
        if not t.is_floating_point() or t.element_size() < 2:
            raise ValueError(f"train.lora.base_from={lora.base_from!r}: tensor {name} is stored as {t.dtype}; "
                             "a router to save is read as it is (no float8 dequantisation here)")
        return t
    return read


def moved_bias(model: MoEModel, read_run: Callable[[str], torch.Tensor],
               read_base: Callable[[str], torch.Tensor]) -> set[int]:
    """The MoE blocks whose router bias in the run differs from the base's (module note)."""
    out = set()
    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}.ffn.router.expert_bias"
        if block.is_moe and getattr(block.ffn.router, "expert_bias", None) is not None:
            if not torch.equal(read_run(name).float(), read_base(name).float()):
                out.add(i)
    return out


def tensor(entry: Entry, read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    t = read(entry.param)
    t = t[entry.index] if entry.index else t
    t = experts_A(t) if entry.layout == "experts_A" else experts_B(t) if entry.layout == "experts_B" else t
    return t.to(dtype).contiguous()


def export_adapters(run_dir: str | Path, out: str | Path, family: str, dtype: torch.dtype = torch.float32,
                    progress: bool = False) -> list[str]:
    """Write RUN's adapters as a peft folder (module note); returns the files written. The caller
    (export_hf.export) has refused a packed run and checked --out and --dtype."""
    from ..runs.dist_checkpoint import trainer_state
    from ..runs.load import run_config

    save_file = require("safetensors.torch", "dropless export-hf --adapters-only", "save_file")
    cfg, path = run_config(run_dir)
    lora = cfg.train.lora
    with torch.device("meta"):  # shapes and names only
        model = MoEModel(cfg.model, lora=lora if lora.enabled else None)
    refuse(cfg, family, model)
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    biases = [f"blocks.{i}.ffn.router.expert_bias" for i, b in enumerate(model.blocks)
              if b.is_moe and getattr(b.ffn.router, "expert_bias", None) is not None]
    tensors = open_tensors(path)  # checked first: every tensor this export may read from it
    check(tensors, {n: TensorSpec(tuple(named[n].shape), named[n].dtype) for n in trainable_names(model) + biases},
          str(path))
    lora_base.check_digest(trainer_state(path).get("lora_base"),
                           lora_base.base_digest(lora, cfg.train.seed, progress), str(path))
    read_base = base_reader(lora, model, family)
    table = plan(model, lora, family, moved_bias(model, tensors.read, read_base))
    if lora.base != "fp32":
        print(f"dropless export-hf: note: train.lora.base={lora.base!r}: the adapters trained against the base "
              "quantised; peft applies them to the full-precision base (merge-lora merges into the "
              "dequantised one)", file=sys.stderr)
    state = {e.key: tensor(e, read_base if e.base else tensors.read, dtype) for e in table.entries}
    with atomic.build_dir(out) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(cfg, table), indent=2) + "\n")
    return [CONFIG_FILE, WEIGHTS_FILE]
