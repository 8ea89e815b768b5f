"""One typed configuration tree for dropless.

Design:
- Plain dataclasses holding plain values only (numbers, strings, bools, tuples, None): no modules,
  process groups or tensors, so a config can be printed, saved as TOML/JSON and diffed.
- Each dataclass validates itself in `__post_init__` and raises `ValueError` naming the dotted field
  and the bad value. Cross-field rules (k <= E, groups divide E, ...) live in the class that owns both
  fields.
- Presets are TOML files under `presets/`; `load_config` reads one, `apply_overrides` sets fields by
  dotted name (`model.moe.top_k=4`), parsing the string with the field's declared type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from .configtree import (
    _choice,
    _fail,
    _positive,
    apply_overrides,
    dumps_toml,
    from_dict,
    load_toml,
    parse_value,
    to_dict,
)

from .moe_config import (
    SCORE_FUNCS,
    ACTIVATIONS,
    BACKENDS,
    DROP_POLICIES,
    PRECISIONS,
    PRECISION_WIDTH_BLOCK,
    STRATEGIES,
    RouterConfig,
    BalanceConfig,
    MoEConfig,
)

from .attn_config import ATTENTIONS, YarnConfig, check_attention  # noqa: F401  (re-exported)
from .model_knobs import check_model_knobs, moe_layer_ids  # noqa: E402

from .parallel_config import EP_DISPATCH, EP_MODES, ON_OVERFLOW, ParallelConfig  # noqa: F401,E402  (re-exported)
from .pipeline_config import check_pipeline_run  # noqa: E402
from .lora_config import LORA_BASES, LORA_TARGETS, LoRAConfig, check_lora_model  # noqa: F401,E402
from .train_config import (  # noqa: F401,E402  (re-exported)
    COMPILE_ALIASES, COMPILE_MODES, DEVICES, DTYPES, OPTIMIZERS, SCHEDULES, TrainConfig)


# ---------------------------------------------------------------------------------------------------
# The model and the run.

TOKENIZERS = ("byte", "hf")
LOSS_ON = ("auto", "all", "assistant")
OVERLONG = ("refuse", "truncate")


@dataclass
class ModelConfig:
    """Decoder-only MoE LM: the first `n_dense_layers` use a dense MLP, the rest an MoE layer."""

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # grouped-query attention: key/value heads, each shared by n_heads / n_kv_heads query heads
    # (0 = n_heads: multi-head attention)
    n_kv_heads: int = 0
    head_dim: int = 0  # width of one head (0 = d_model / n_heads; Qwen3 sets it explicitly)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary (Qwen3)
    attn_bias: bool = False  # biases on the q, k, v and output projections
    # "standard": multi-head / grouped-query attention (model.py); "mla": DeepSeek's multi-head latent
    # attention (layers/mla.py), where head_dim is the query/key head width (its nope + rope parts)
    attention: str = "standard"
    q_lora_rank: int = 0  # mla: rank of the query projection (0 = one full-rank query projection)
    kv_lora_rank: int = 0  # mla: width of the key/value latent
    rope_head_dim: int = 0  # mla: the rotary part of each query/key head (one key part for all heads)
    v_head_dim: int = 0  # mla: width of a value head (0 = head_dim)
    rope_interleave: bool = False  # mla: rotary dims stored as interleaved pairs (DeepSeek's layout)
    max_seq_len: int = 256
    n_dense_layers: int = 1
    # which layers after the dense prefix are MoE (model_knobs.py): every n-th one counted from the
    # first layer after the prefix, or an explicit list of layer indices (all >= n_dense_layers)
    moe_layer_freq: Union[int, list[int]] = 1
    block: str = "sequential"  # or "parallel_moe": MoE blocks read x, not x + attn (model_knobs.py)
    mtp_depth: int = 0  # multi-token prediction modules (layers/mtp.py); 0 = off
    mtp_weight: float = 0.3  # the MTP loss's weight (lambda; the mean over the D modules' losses)
    # each MTP module's block: "dense" (the dense MLP) or "moe" (an MoE block, DeepSeek-V3's layout)
    mtp_block: str = "dense"
    d_ff_dense: int = 512  # hidden width of the dense MLP layers
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_yarn: YarnConfig = field(default_factory=YarnConfig)  # YaRN scaling (off by default)
    norm_eps: float = 1e-6
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)
    # activation recompute by module name (layers/recompute.py, docs/recompute.md): any of RECOMPUTE
    recompute: list[str] = field(default_factory=list)
    # activation offload to host memory by module name (layers/offload.py, docs/offload.md): any of OFFLOAD
    offload: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = from_dict(MoEConfig, self.moe, "model.moe.")
        if isinstance(self.rope_yarn, dict):
            self.rope_yarn = from_dict(YarnConfig, self.rope_yarn, "model.rope_yarn.")
        self.rope_yarn.validate("model.rope_yarn")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "d_ff_dense"):
            _positive(f"model.{name}", getattr(self, name))
        for name in ("n_kv_heads", "head_dim"):
            if isinstance(getattr(self, name), bool) or not getattr(self, name) >= 0:
                _fail(f"model.{name}", getattr(self, name), "must be >= 0 (0 = the default)")
        if self.n_heads % self.kv_heads:
            _fail("model.n_kv_heads", self.n_kv_heads, f"does not divide n_heads={self.n_heads}")
        if not self.head_dim and self.d_model % self.n_heads:
            _fail("model.n_heads", self.n_heads, f"does not divide d_model={self.d_model} (or set model.head_dim)")
        check_attention(self)
        for name in ("qk_norm", "attn_bias", "rope_interleave"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"model.{name}", getattr(self, name), "must be true or false")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            _fail("model.n_dense_layers", self.n_dense_layers, f"must be in [0, n_layers={self.n_layers}]")
        if not self.rope_theta > 0:
            _fail("model.rope_theta", self.rope_theta, "must be > 0")
        for name in ("init_std", "norm_eps"):  # negative: the init refuses it, or the norm is NaN
            if not getattr(self, name) >= 0:
                _fail(f"model.{name}", getattr(self, name), "must be >= 0")
        self.moe.validate("model.moe")
        check_model_knobs(self)
        check_recompute(self.recompute, self.moe)
        check_offload(self.offload, self.recompute)
        block = PRECISION_WIDTH_BLOCK.get(self.moe.precision)
        if block and self.n_moe_layers:
            routed = (("model.moe.latent_dim", self.moe.latent_dim) if self.moe.latent_dim
                      else ("model.d_model", self.d_model))  # the width the experts run in
            for name, width in (routed, ("model.moe.d_expert", self.moe.d_expert)):
                if width % block:
                    _fail(name, width, f"must be a multiple of {block} with model.moe.precision="
                          f"{self.moe.precision!r} (its GEMM blocks along both widths)")

    @property
    def rope_width(self) -> int:
        """Dims of a head that the rotary turns: all of it, or MLA's rope part."""
        return self.rope_head_dim if self.attention == "mla" else self.head_width

    @property
    def value_width(self) -> int:
        return self.v_head_dim or self.head_width

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers (the others use the dense MLP)."""
        return moe_layer_ids(self.n_layers, self.n_dense_layers, self.moe_layer_freq)


RECOMPUTE = ("layer", "full", "moe", "attn", "norm", "shared_experts", "moe_act")


def check_recompute(modes: list[str], moe: MoEConfig) -> None:
    """`full` is an alias of `layer` (every block recomputed whole); `layer` with a finer mode is
    refused rather than merged, so a list always says what runs. `moe`/`layer` replay the forward's
    expert ids in the recompute, which needs a fixed top_k per token and weights that depend on the
    ids alone: the validity-masked strategies and norm_top_k are refused."""
    f = "model.recompute"
    if isinstance(modes, str) or not all(isinstance(m, str) for m in modes):
        _fail(f, modes, "must be a list of names")
    for m in modes:
        _choice(f, m, RECOMPUTE)
    if len(set(modes)) < len(modes):
        _fail(f, modes, "lists a name twice")
    whole = [m for m in modes if m in ("layer", "full")]
    if whole and len(modes) > 1:
        _fail(f, modes, f"{whole[0]!r} recomputes the whole block: list it alone or the finer modes")
    if "shared_experts" in modes and "moe" in modes:
        _fail(f, modes, "'moe' recomputes the shared experts already: list one of them")
    if "moe_act" in modes:
        # the lean experts' behaviour, the default (layers/experts.py): accepted where they run
        if "moe" in modes:
            _fail(f, modes, "'moe' recomputes the expert activation already: list one of them")
        if moe.precision != "bf16":
            _fail(f, modes, f"with model.moe.precision={moe.precision!r}: the low-precision experts "
                  "keep their activation ('moe_act' is the full-precision lean path)")
        if moe.capacity_factor is not None or moe.backend == "padded_bmm":
            _fail(f, modes, f"with model.moe.capacity_factor={moe.capacity_factor}: the capacity "
                  "layout keeps its activation ('moe_act' is the dropless lean path)")
    if "shared_experts" in modes and not moe.shared_width:
        _fail(f, modes, f"with model.moe.n_shared_experts={moe.n_shared_experts}: no shared experts")
    if whole or "moe" in modes:
        r = moe.router
        if r.strategy in ("expert_choice", "expert_threshold"):
            _fail(f, modes, f"with model.moe.router.strategy={r.strategy!r}: recompute replays the "
                  "forward's top_k ids, and this strategy has a variable number per token")
        if r.norm_top_k is not None:
            _fail(f, modes, f"with model.moe.router.norm_top_k={r.norm_top_k}: the replayed ids do "
                  "not give the norm_top_k denominator")


OFFLOAD = ("layer", "attn", "attn_input", "norm", "moe", "experts")
# each scope's enclosing scope: two names overlap when one is the other or encloses it
_SCOPE_PARENT = {"attn": "layer", "norm": "layer", "moe": "layer", "attn_input": "attn",
                 "experts": "moe", "shared_experts": "moe", "full": "layer"}


def _scopes(name: str) -> set[str]:
    out = {"layer" if name == "full" else name}
    while name in _SCOPE_PARENT:
        name = _SCOPE_PARENT[name]
        out.add(name)
    return out


def check_offload(names: list[str], recompute: list[str]) -> None:
    """Offload scopes must not overlap each other nor a recomputed scope (layers/offload.py says why)."""
    f = "model.offload"
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        _fail(f, names, "must be a list of names")
    for n in names:
        if n == "expert_fc1_input":
            _fail(f, n, "is not a module scope (the experts' first GEMM is a function inside them); "
                  "'experts' offloads everything the routed experts save, their input rows included")
        _choice(f, n, OFFLOAD)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a in _scopes(b) or b in _scopes(a):
                _fail(f, names, f"{a!r} and {b!r} overlap: list the outer one or the inner one")
        for r in recompute:
            if a in _scopes(r) or ("layer" if r == "full" else r) in _scopes(a):
                _fail(f, names, f"{a!r} overlaps model.recompute {r!r}: a scope is either recomputed "
                      "or offloaded")


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=list)  # files, folders or .jsonl; empty = the stdlib corpus
    text_field: str = "text"  # JSONL field holding the text
    tokenizer: str = "byte"
    tokenizer_path: Optional[str] = None  # a local tokenizer.json for tokenizer="hf"
    val_fraction: float = 0.05
    max_bytes: int = 0  # cap on corpus bytes (0 = all)
    replay_routing: str = ""  # a routing record to train on with its expert ids (data/replay.py)
    prepared: str = ""  # a folder written by `dropless prepare-data` (instead of sources; memory-mapped)
    # attention and rotary positions stay inside each document of a packed window, and a target in
    # another document takes no loss (data/windows.py); None: on for chat data, off for text
    document_mask: Optional[bool] = None
    loss_on: str = "auto"  # "all" tokens, "assistant" replies only (chat data), "auto": assistant for chat
    overlong: str = "refuse"  # a chat example longer than train.seq_len + 1: "refuse" or "truncate"
    chat_field: str = "messages"  # JSONL field holding a conversation (a .jsonl with it is chat data)

    def __post_init__(self) -> None:
        _choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        if self.tokenizer == "hf" and not self.tokenizer_path:
            _fail("data.tokenizer_path", self.tokenizer_path, "tokenizer='hf' needs a tokenizer.json path")
        if not 0 < self.val_fraction < 1:
            _fail("data.val_fraction", self.val_fraction, "must be in (0, 1)")
        if self.max_bytes < 0:
            _fail("data.max_bytes", self.max_bytes, "must be >= 0")
        if isinstance(self.sources, str):
            self.sources = [self.sources]
        _choice("data.loss_on", self.loss_on, LOSS_ON)
        _choice("data.overlong", self.overlong, OVERLONG)
        if self.prepared and self.sources:
            _fail("data.prepared", self.prepared, f"and data.sources={self.sources} both set: a prepared "
                  "folder is the whole corpus (prepare the sources into it)")
        if self.prepared and self.max_bytes:
            _fail("data.max_bytes", self.max_bytes, "caps the sources read in memory, not a prepared folder")
        if self.replay_routing and (self.document_mask or self.loss_on == "assistant"):
            _fail("data.replay_routing", self.replay_routing, "trains on a record's own sequences: "
                  "data.document_mask and data.loss_on=assistant do not apply to it")


@dataclass
class LogConfig:
    log_every: int = 10  # steps between host syncs for metrics (and the routing-health record)
    progress: bool = True  # a progress bar on stderr
    tensorboard: bool = True  # TensorBoard events, when the tensorboard package is installed
    plots: bool = True  # PNG plots at the end of the run (needs matplotlib)

    def __post_init__(self) -> None:
        _positive("log.log_every", self.log_every)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            _fail("train.seq_len", self.train.seq_len, f"exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.model.mtp_depth >= self.train.seq_len:  # (evaluation and generation never run MTP)
            _fail("model.mtp_depth", self.model.mtp_depth, f"must be < train.seq_len={self.train.seq_len}: "
                  "module D predicts token t+D+1, so a window of seq_len inputs leaves it seq_len - D targets")
        if self.data.tokenizer == "byte" and self.model.vocab_size < 256:  # (hf: checked on loading it)
            _fail("model.vocab_size", self.model.vocab_size, "is below the 256 ids of data.tokenizer='byte'")
        self.parallel.check_run(self.model.moe, self.train.batch_size * self.train.seq_len, self.train.optimizer)
        check_lora_model(self.train.lora, self.model, self.parallel, self.train.optimizer)
        check_pipeline_run(self)
        p = self.parallel
        if self.train.compile == "step" and p.ep_size > 1 and (p.fsdp or not p.ep_capturable):
            _fail("train.compile", "step", f"with parallel.ep_size={p.ep_size}: the whole step is one graph "
                  "only on the traceable parts: set parallel.fsdp=false (FSDP2's hooks cannot be traced) "
                  "and parallel.ep_capturable=true (buffered EP on functional collectives), or use "
                  f"train.compile=blocks (got parallel.fsdp={str(p.fsdp).lower()}, "
                  f"parallel.ep_capturable={str(p.ep_capturable).lower()})")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A preset file (or the defaults) with dotted overrides applied, validated."""
    cfg = from_dict(RunConfig, load_toml(path)) if path is not None else RunConfig()
    return apply_overrides(cfg, overrides or [])


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(dumps_toml(to_dict(cfg)))
