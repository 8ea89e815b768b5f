"""The combination matrix's factors: every knob that changes the model, the routing, the parallel layout,
the precision or the memory mode, each with the values the matrix tries.

A factor is one line of `FACTORS`: its name and its values, the first being the default (no
override). A value is a short label and the dotted `--set` overrides it applies; one value may set
several fields when they only mean something together (loss-free bias = use_expert_bias + a rate).
No two factors set the same field (tests/check/test_matrix.py checks it), so any two values can meet
in a row. Two spellings are not config:
- `{model.moe.num_experts}` in a value is replaced by that field's value in the row (k = E whatever E);
- `stage.NAME=value` is an option of a stage, not a config field (`resume_optimizer`: the resume with a
  changed train field also changes train.optimizer).

Widths are chosen so each value is legal on its own with `BASE` (d_model 64, d_expert 32: blocks of 32
for mxfp8/mxfp4, 16 for nvfp4); fp8_blockwise's 128-wide blocks come with their own widths. What is
left out, and why, is `LEFT_OUT`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

# Tiny sizes on top of the `tiny` preset: a row trains in about a second on one core.
BASE = [
    "train.device=cpu", "train.dtype=fp32", "train.threads=1", "train.optimizer=adamw", "train.lr=1e-2",
    "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.max_seq_len=32", "model.d_ff_dense=64",
    "model.n_dense_layers=0", "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_expert=32",
    "train.batch_size=2", "train.seq_len=16", "train.steps=2", "train.warmup_steps=0",
    "train.eval_every=2", "train.eval_batches=1", "train.ckpt_every=2",
    "data.max_bytes=50000", "log.log_every=1", "log.progress=false", "log.tensorboard=false", "log.plots=false",
]
PRESET = "tiny"
_FIELD = re.compile(r"\{([\w.]+)\}")

R, B, M = "model.moe.router.", "model.moe.balance.", "model.moe."
BIAS = [f"{R}use_expert_bias=true", f"{B}bias_update_rate=0.01"]
EP2 = ["parallel.ep_size=2"]
BUFFERED = [*EP2, "parallel.ep_mode=buffered", "parallel.overflow_check_every=1"]

FACTORS: list[tuple[str, dict[str, list[str]]]] = [
    ("experts", {"E4": [], "E5": [f"{M}num_experts=5"]}),
    ("top_k", {"k2": [], "k1": [f"{M}top_k=1"], "k=E": [f"{M}top_k={{model.moe.num_experts}}"]}),
    ("score", {"softmax": [], "sigmoid": [f"{R}score_func=sigmoid"],
               "sqrt_softplus": [f"{R}score_func=sqrt_softplus"], "post-softmax": [f"{R}pre_softmax=false"]}),
    ("weights", {"renorm": [], "raw": [f"{R}renormalize=false"], "scale2.5": [f"{R}scaling_factor=2.5"],
                 "norm_top_k3": [f"{R}norm_top_k=3"]}),
    ("strategy", {"token_choice": [], "expert_choice": [f"{R}strategy=expert_choice"],
                  "expert_threshold": [f"{R}strategy=expert_threshold"],
                  "hash": [f"{R}strategy=hash", f"{R}hash_buckets=64"],
                  "forced_balance": [f"{R}strategy=forced_balance"]}),
    ("groups", {"-": [], "groups2/1": [f"{R}n_groups=2", f"{R}topk_groups=1"]}),
    ("balance", {"aux": [], "seq+global-aux": [f"{B}aux_loss_coeff=0", f"{B}seq_aux_loss_coeff=0.01",
                                               f"{B}global_aux_loss_coeff=0.01"],
                 "bias-sign": BIAS,
                 "bias-prop-lr": [*BIAS, f"{B}bias_update_rule=proportional", f"{B}bias_rate_schedule=lr"],
                 "bias-adaptive-warm": [*BIAS, f"{B}bias_update_rule=adaptive", f"{B}bias_warm_start_steps=1"],
                 "quantile": [f"{R}use_expert_bias=true", f"{B}quantile_balance=true",
                              f"{B}quantile_momentum=0.5"]}),
    ("capacity", {"dropless": [], "cap1.25": [f"{M}capacity_factor=1.25"],
                  "cap1.0-score": [f"{M}capacity_factor=1.0", f"{M}drop_policy=score"]}),
    ("backend", {"auto": [], "loop": [f"{M}backend=loop"],
                 "grouped_mm-align8": [f"{M}backend=grouped_mm", f"{M}align=8"]}),
    ("precision", {"bf16": [], "mxfp8": [f"{M}precision=mxfp8"], "nvfp4": [f"{M}precision=nvfp4"],
                   "mxfp4": [f"{M}precision=mxfp4"],
                   "fp8_blockwise": [f"{M}precision=fp8_blockwise", "model.d_model=128", f"{M}d_expert=128"]}),
    ("activation", {"swiglu": [], "geglu": [f"{M}activation=geglu"], "relu2": [f"{M}activation=relu2"],
                    "swiglu-clamp": [f"{M}act_clamp=1.0"], "swiglu-softcap": [f"{M}act_softcap=2.0"]}),
    ("shared", {"-": [], "shared1": [f"{M}n_shared_experts=1"],
                "shared2x16": [f"{M}n_shared_experts=2", f"{M}d_shared=16"]}),
    ("identity", {"-": [], "identity2": [f"{M}n_identity_experts=2"]}),
    ("latent", {"-": [], "latent32": [f"{M}latent_dim=32"],
                "latent32-norm": [f"{M}latent_dim=32", f"{M}latent_norm=true"]}),
    ("attention", {"mha": [], "gqa+bias": ["model.n_heads=4", "model.n_kv_heads=2", "model.attn_bias=true"],
                   "head_dim24+qk_norm": ["model.head_dim=24", "model.qk_norm=true"],
                   "mla": ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
                           "model.rope_head_dim=8", "model.v_head_dim=16", "model.rope_interleave=true"],
                   "yarn": ["model.rope_yarn.factor=2.0", "model.rope_yarn.original_max_seq_len=16"]}),
    ("layers", {"all-moe": [], "dense-prefix1": ["model.n_dense_layers=1"], "freq2": ["model.moe_layer_freq=2"],
                "list[1]": ["model.moe_layer_freq=[1]"]}),
    ("block", {"sequential": [], "parallel_moe": ["model.block=parallel_moe"]}),
    ("mtp", {"-": [], "mtp1": ["model.mtp_depth=1"], "mtp2": ["model.mtp_depth=2", "model.mtp_weight=0.5"],
             "mtp1-moe": ["model.mtp_depth=1", "model.mtp_block=moe"]}),
    ("tied", {"tied": [], "untied": ["model.tie_embeddings=false"]}),
    ("recompute", {"-": [], "layer": ['model.recompute=["layer"]'], "moe": ['model.recompute=["moe"]'],
                   "attn+norm": ['model.recompute=["attn","norm"]'], "moe_act": ['model.recompute=["moe_act"]']}),
    ("offload", {"-": [], "attn+norm+moe": ['model.offload=["attn","norm","moe"]'],
                 "experts": ['model.offload=["experts"]'], "attn_input": ['model.offload=["attn_input"]']}),
    ("optimizer", {"adamw": [], "adamw_bf16": ["train.optimizer=adamw_bf16"], "muon": ["train.optimizer=muon"],
                   "muon-ns-bf16": ["train.optimizer=muon", "train.muon_ns_dtype=bf16"],
                   "muon-ns-fp32": ["train.optimizer=muon", "train.muon_ns_dtype=fp32"]}),
    ("dtype", {"fp32": [], "bf16": ["train.dtype=bf16"]}),
    ("compile", {"eager": [], "compile": ["train.compile=blocks"], "step": ["train.compile=step"]}),
    ("grad_accum", {"1": [], "accum2": ["train.grad_accum=2"]}),
    ("layout", {"1proc": [], "ep2": EP2,
                "ep2-buf-spill": [*BUFFERED, "parallel.ragged_buffer_factor=1.0", "parallel.on_overflow=spill",
                                  "parallel.dedup=false"],
                "ep2-buf-auto-hot": [*BUFFERED, "parallel.ragged_buffer_factor=auto", "parallel.on_overflow=retry",
                                     "parallel.replicate_hot_experts=1", "parallel.replica_interval=1",
                                     "parallel.overlap_shared=false", "parallel.check_collectives=true"],
                # ring dispatch: all-gather the tokens, reduce-scatter the results (exact and static sizes)
                "ep2-ring": [*EP2, "parallel.ep_dispatch=ring"],
                "ep2-buf-ring": [*BUFFERED, "parallel.ep_dispatch=ring", "parallel.on_overflow=retry"],
                # buffered EP on functional collectives: traced without a graph break where compiled
                "ep2-buf-capture": [*BUFFERED, "parallel.ep_capturable=true", "parallel.on_overflow=retry"],
                # ... with spill decided on the device (links at half the balanced load; row slots below
                # the micro-batch: de-dup's second buffer holds the whole worst case), without FSDP2
                # (dense weights whole on every rank): the whole step compiles
                "ep2-buf-capture-repl": [*BUFFERED, "parallel.ep_capturable=true", "parallel.on_overflow=spill",
                                         "parallel.ragged_buffer_factor=0.5", "parallel.fsdp=false"],
                # two-level dispatch: the two ranks as two nodes of one (rail trip, then a node of one)
                "ep2-node": [*EP2, "parallel.ep_hierarchy=node", "parallel.ep_node_size=1"],
                # ... buffered, blocks at half the balanced load: the rail overflows, the step is rerun
                # with worst-case blocks (tests/distributed/test_ep_hier.py covers spill)
                "ep2-buf-node": [*BUFFERED, "parallel.ep_hierarchy=node", "parallel.ep_node_size=1",
                                 "parallel.ragged_buffer_factor=0.5", "parallel.on_overflow=retry"],
                # pipeline stages: two ranks of one stage each; zbv's two stages per rank need 4 blocks
                "pp2-1f1b": ["parallel.pp_size=2"],
                "pp2-zbv": ["parallel.pp_size=2", "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2",
                            "parallel.pp_microbatches=2", "parallel.pp_layers=[1,1,1,1]", "model.n_layers=4"]}),
    # the EP dispatch's token rows on the wire; one process rounds them alike (a short last block at d 64)
    ("payload", {"native": [], "mxfp8": ["parallel.dispatch_dtype=mxfp8"],
                 "fp8_blockwise": ["parallel.dispatch_dtype=fp8_blockwise"]}),
    ("resume_change", {"lr": [], "optimizer": ["stage.resume_optimizer=true"]}),
    # low-rank adapters on a frozen base (the base: train.seed's weights), held in bf16, or packed (QLoRA)
    ("lora", {"-": [], "attn+experts": ["train.lora.rank=4"],
              "router+experts-bf16": ["train.lora.rank=2", "train.lora.alpha=8",
                                      'train.lora.targets=["router","experts"]', "train.lora.base=bf16"],
              "qlora-mxfp4": ["train.lora.rank=4", "train.lora.base=mxfp4"]}),
    # data_setup.py makes the files: a prepared folder of the row's corpus; a chat tokenizer and its
    # conversations (longer windows: a conversation is 20-70 tokens; a longer one is cut)
    ("data", {"corpus": [], "doc-mask": ["data.document_mask=true"], "prepared": ["stage.data=prepared"],
              "chat": ["stage.data=chat", "model.vocab_size=320", "model.max_seq_len=96", "train.seq_len=80",
                       "data.overlong=truncate"]}),
]

# Rows each Hugging Face family can express, run after the covering rows: a pairwise row almost never
# is one (Qwen3-MoE needs q/k norms, DeepSeek-V3 MLA, sigmoid scores, the expert bias and shared experts
# at once, and any one of a dozen knobs rules all three out), so without these export-hf would only
# ever be refused. Each lists its non-default values.
FAMILY_ROWS = {
    "mixtral": {"top_k": "k=E", "balance": "seq+global-aux", "tied": "untied", "precision": "mxfp8",
                "optimizer": "muon", "layout": "ep2"},
    "qwen3_moe": {"attention": "head_dim24+qk_norm", "layers": "dense-prefix1", "top_k": "k1", "mtp": "mtp1",
                  "recompute": "attn+norm", "dtype": "bf16"},
    "deepseek_v3": {"attention": "mla", "score": "sigmoid", "balance": "bias-adaptive-warm", "shared": "shared1",
                    "groups": "groups2/1", "weights": "scale2.5", "layers": "dense-prefix1", "grad_accum": "accum2",
                    "mtp": "mtp1-moe"},
}

# Pairs the generator puts in as few rows as it can (once each): a real inductor compile costs about
# 100 s of CPU on a 2-core runner. These rows build with inductor; every other row that compiles traces
# the same graphs with train.compile_backend=aot_eager (matrix.py `spec_of`): graph breaks, recompiles
# and tracing failures show there in seconds, inductor's code generation in these rows.
EXPENSIVE = [(("compile", "compile"), ("dtype", "bf16")), (("compile", "step"), ("dtype", "bf16"))]

LEFT_OUT = {
    "model.recompute shared_experts / full": "shared_experts needs shared experts (a value may not depend on "
                                             "another factor's); full is an alias of layer",
    "model.offload layer": "overlaps every recompute value; the inner scopes cover its hooks",
    "data.tokenizer hf on text": "the chat value trains with an HF tokenizer; text through it takes the same "
                                 "window path as bytes (tests/data/)",
    "data.loss_on, data.chat_field, data.sources, data.text_field": "at their defaults (auto: the assistant "
        "loss for the chat value, every token for text); tests/data/ covers each",
    "router expert_capacity_factor, threshold_momentum, max_experts_per_token": "strategy parameters, at their "
                                                                                "defaults",
    "balance z_loss_coeff": "on (its default) in every row",
    "rope_yarn beta_fast, beta_slow, mscale, mscale_all_dim": "YaRN's shape parameters, at their defaults",
    "train schedule, warmup, lr, betas, weight_decay, grad_clip, seed": "the trainer's numbers, not a model, "
                                                                         "routing, layout, precision or memory knob",
    "model.init_std, norm_eps, rope_theta, vocab_size, d_ff_dense, n_layers": "numbers with no code path of "
                                                                              "their own",
    "parallel.max_tokens_per_rank, collective_timeout_s, a2a_alarm_ratio, retry_on_overflow": "bounds and "
        "alarms on the EP values' paths (on_overflow supersedes retry_on_overflow)",
    "world 2 without EP (ep_size 1)": "validation does not see the world size, so a pair data parallel "
        "cannot take (the capacity baseline: ranks install the EP dispatcher at ep_size 1 too) would stop at "
        "launch instead of being refused; tests/distributed/ trains it, with check_collectives on",
    "ep_size 4": "CI has 2 cores: the EP rows are the world-2 rows",
    "pp with ep or edp; schedules gpipe, interleaved_1f1b, zero_bubble": "world 4, or the same stage code under "
        "another torch schedule: tests/distributed/test_pipeline.py runs each against one process",
    "train.lora.layers, dropout, base_from; targets shared, dense, mla_low_rank": "they depend on other factors' "
        "values (which blocks are MoE, shared experts, MLA) or on a base on disk; tests/test_lora*.py cover them",
    "train.device cuda, train.deterministic": "the CPU CI trains deterministically on the CPU",
}


@dataclass(frozen=True)
class Value:
    factor: str
    label: str
    overrides: tuple[str, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        """The dotted config fields this value sets (stage options excluded)."""
        return tuple(o.split("=", 1)[0] for o in self.overrides if not o.startswith("stage."))


def family_row(family: str) -> tuple[int, ...]:
    """FAMILY_ROWS[family] as value indices, one per factor."""
    labels = FAMILY_ROWS[family]
    return tuple(next(i for i, v in enumerate(f) if v.label == labels.get(f[0].factor, f[0].label))
                 for f in factors())


def factors() -> list[list[Value]]:
    """FACTORS as Values, factor by factor (index 0 of each is its default)."""
    return [[Value(name, label, tuple(ovr)) for label, ovr in values.items()] for name, values in FACTORS]


def config_overrides(values: list[Value], base_value: Callable[[str], Any]) -> list[str]:
    """The `--set` overrides of a row's values (stage options dropped, `{field}` filled in from the
    row's own overrides, else from `base_value(field)`)."""
    own = [o for v in values for o in v.overrides if not o.startswith("stage.")]
    known = dict(o.split("=", 1) for o in own)

    def fill(m: re.Match) -> str:
        return known[m[1]] if m[1] in known else str(base_value(m[1]))

    return [_FIELD.sub(fill, o) for o in own]


def stage_options(values: list[Value]) -> dict[str, str]:
    return dict(o[len("stage."):].split("=", 1) for v in values for o in v.overrides if o.startswith("stage."))
