"""`dropless upcycle HF_DENSE_DIR --experts E --top-k K [--granularity G] --out RUN_DIR`: a dense
Qwen3 or Llama-style checkpoint as the step-0 run of an MoE model (sparse upcycling).

    dropless upcycle DIR --experts E --top-k K [--granularity G] --out RUN_DIR [--seed S] [--set a.b=v ...]

Legend: D model width, F the dense MLP's hidden width, G granularity, F/G one expert's width, E experts,
K experts per token.

Every layer becomes an MoE layer; attention, norms, embeddings and head are copied unchanged (the same
tensor map as import-hf: a dense Qwen3 / Llama checkpoint is a Qwen3-MoE one whose layers are all
dense, hf/mapping.py). Expert e is slice s = e mod G of the dense MLP's hidden units, [s F/G, (s+1) F/G):
    gate, up: rows s of the dense gate_proj / up_proj ([F, D] -> [F/G, D]);
    down:     columns s of down_proj ([D, F] -> [D, F/G]), times G.
Why the output is kept: a SwiGLU MLP is a sum over its hidden units, down(silu(gate x) * up x) =
sum_s down[:, s](silu(gate[s] x) * up[s] x), so the G slices sum to the dense MLP exactly. The router
(softmax over all E, then top-K, renormalised to sum to 1) starts small and random (normal, std
`initializer_range`). With G = 1 every expert is the whole MLP and the K weights sum to 1, so the MoE
layer's output equals the dense MLP's for any router (K >= 2; with K = 1 the weight is the raw
probability, which is 1 only for E = 1: renormalising one weight would freeze the router). With G > 1
the scale G makes K = G chosen experts that are one copy of each slice, with equal weights 1/G, sum to
the dense MLP; a random router picks other sets too, so the output is then only close to the dense one
(the usual granular-upcycling trade: Komatsuzaki et al. 2022; He et al. 2024 for the weight scale).

Balancing: dropless's defaults (aux loss 0.01 per MoE layer, z-loss 1e-3), said in the log.
Memory: the dense model and the MoE model are both held while the experts are copied.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, RunConfig
from ..model import MoEModel
from ..moe_config import MoEConfig, RouterConfig
from . import rope
from .defaults import Fields, refuse
from .import_hf import check_out, load_weights, read_config, run_config, save_run, shard_files

DENSE_FAMILIES = ("qwen3", "llama")


def dense_config(hf: dict[str, Any], experts: int, top_k: int, granularity: int = 1) -> ModelConfig:
    """The dense checkpoint as a dropless model whose layers are all dense (n_dense_layers = n_layers),
    carrying the MoE shape the upcycled model will have; a key config.json omits is transformers'
    default (hf/defaults.py)."""
    family = hf.get("model_type")
    if family not in DENSE_FAMILIES:
        refuse("model_type", family, f"upcycle reads dense {' / '.join(DENSE_FAMILIES)} checkpoints")
    f = Fields(hf, family)
    if f("hidden_act") != "silu":
        refuse("hidden_act", f("hidden_act"), "only silu (SwiGLU MLPs) is supported")
    if family == "llama" and f("mlp_bias"):
        refuse("mlp_bias", True, "the experts have no biases")
    if family == "qwen3" and f("use_sliding_window"):
        refuse("use_sliding_window", True, "sliding-window attention is not supported")
    if float(f("attention_dropout")) != 0.0:
        refuse("attention_dropout", f("attention_dropout"), "dropless has no attention dropout")
    F, H, d = int(f("intermediate_size")), int(f("num_attention_heads")), int(f("hidden_size"))
    for flag, v in (("--experts", experts), ("--top-k", top_k), ("--granularity", granularity)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} {v!r}: must be an integer >= 1")
    if F % granularity:
        raise ValueError(f"--granularity {granularity}: does not divide intermediate_size={F}")
    if experts % granularity:
        raise ValueError(f"--experts {experts}: must be a multiple of --granularity {granularity} (each "
                         "slice of the dense MLP gets the same number of copies)")
    if top_k > experts:
        raise ValueError(f"--top-k {top_k}: exceeds --experts {experts}")
    moe = MoEConfig(num_experts=experts, top_k=top_k, d_expert=F // granularity, activation="swiglu",
                    router=RouterConfig(score_func="softmax", pre_softmax=True, renormalize=True))
    n_layers, kv, head_dim = int(f("num_hidden_layers")), f("num_key_value_heads"), f("head_dim")
    theta, _ = rope.read(f)
    return ModelConfig(
        vocab_size=int(f("vocab_size")), d_model=d, n_layers=n_layers, n_heads=H,
        n_kv_heads=H if kv is None else int(kv), head_dim=int(head_dim or d // H),
        qk_norm=family == "qwen3", attn_bias=bool(f("attention_bias")),
        max_seq_len=int(f("max_position_embeddings")), n_dense_layers=n_layers, d_ff_dense=F,
        tie_embeddings=bool(f("tie_word_embeddings")), rope_theta=theta,
        norm_eps=float(f("rms_norm_eps")), init_std=float(f("initializer_range")), moe=moe)


def load_dense(hf_dir: str | Path, experts: int = 1, top_k: int = 1, granularity: int = 1) -> MoEModel:
    """The dense checkpoint as a dropless model (all layers dense), fp32, eval mode."""
    cfg = dense_config(read_config(hf_dir), experts, top_k, granularity)
    shard_files(hf_dir)
    model = MoEModel(cfg)
    load_weights(model, hf_dir, "qwen3_moe", progress=False)  # the dense rows of Qwen3-MoE's table
    return model.eval()


@torch.no_grad()
def upcycle_model(dense: MoEModel, granularity: int = 1, seed: int = 0, cfg: ModelConfig | None = None) -> MoEModel:
    """The MoE model of `dense` (module note); `cfg`: the MoE config (default: dense's, every layer MoE)."""
    cfg = cfg or replace(dense.cfg, n_dense_layers=0)
    moe = MoEModel(cfg)
    src = dict(dense.named_parameters())
    for name, p in moe.named_parameters():
        if name in src:  # embeddings, norms, attention, head: the same tensors
            p.copy_(src[name])
    G, E, F = granularity, moe.expert_slots().routed, dense.cfg.d_ff_dense
    Fg = F // G
    g = torch.Generator().manual_seed(seed)
    for block, dense_block in zip(moe.blocks, dense.blocks):
        gate_up, down = dense_block.ffn.gate_up.weight, dense_block.ffn.down.weight  # [2F, D], [D, F]
        for e in range(E):
            s = slice((e % G) * Fg, (e % G + 1) * Fg)
            w = torch.cat([gate_up[:F][s], gate_up[F:][s]], dim=0)  # [2 F/G, D]: [gate | up]
            block.ffn.experts.w_gate_up_EDF[e].copy_(w.t())
            block.ffn.experts.w_down_EFD[e].copy_(down[:, s].t() * G)
        router = block.ffn.router.weight
        router.copy_(torch.randn(router.shape, generator=g) * cfg.init_std)
    return moe


def write_run(hf_dir: str | Path, out: str | Path, experts: int, top_k: int, granularity: int = 1,
              seed: int = 0, overrides: list[str] | None = None) -> RunConfig:
    """Upcycle `hf_dir` into the run directory `out`; returns its config."""
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    check_out(hf_dir, out, overrides or [])
    dense_cfg = dense_config(read_config(hf_dir), experts, top_k, granularity)
    cfg = run_config(replace(dense_cfg, n_dense_layers=0), out / "tokenizer" / "tokenizer.json", overrides or [])
    dense = load_dense(hf_dir, experts, top_k, granularity)
    model = upcycle_model(dense, granularity, seed, cfg.model)
    save_run(model, cfg, hf_dir, out, {"upcycled": {"experts": experts, "top_k": top_k,
                                                    "granularity": granularity, "seed": seed}})
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dropless upcycle",
                                description="Upcycle a dense Hugging Face Qwen3 / Llama checkpoint into an MoE run.")
    p.add_argument("hf_dir", metavar="HF_DENSE_DIR", help="folder with config.json, *.safetensors, tokenizer.json")
    p.add_argument("--experts", type=int, required=True, metavar="E")
    p.add_argument("--top-k", type=int, required=True, metavar="K")
    p.add_argument("--granularity", type=int, default=1, metavar="G",
                   help="split the dense MLP into G slices; expert e starts as slice e mod G (default 1)")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="the run directory to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the router's random init")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value",
                   help="override a field of the run's config (repeatable)")
    args = p.parse_args(argv)
    try:
        cfg = write_run(args.hf_dir, args.out, args.experts, args.top_k, args.granularity, args.seed, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"dropless upcycle: error: {err}", file=sys.stderr)
        return 2
    print(f"upcycled {args.hf_dir} into {args.out}: {args.experts} experts of width {cfg.model.moe.d_expert}, "
          f"top-{args.top_k}, granularity {args.granularity}")
    b = cfg.model.moe.balance
    rules = [f"aux loss {b.aux_loss_coeff:.4g}" if b.aux_loss_coeff else "", f"z-loss {b.z_loss_coeff:.4g}" if b.z_loss_coeff else ""]
    print("balancing: " + ("; ".join(r for r in rules if r) or "NONE (every balancing coefficient is 0)")
          + " (dropless's defaults; --set model.moe.balance.* to change)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
