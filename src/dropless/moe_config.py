"""The MoE part of the config tree: the router, the balancing rules and the MoE layer
(`model.moe`, `model.moe.router`, `model.moe.balance`). Same design as config.py (plain dataclasses,
validated in `__post_init__`, `ValueError` naming the dotted field); config.py re-exports every name
here, so `from dropless.config import MoEConfig` is the public spelling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .configtree import _choice, _fail, _positive
from .expert_slots import ExpertSlots

SCORE_FUNCS = ("softmax", "sigmoid", "sqrt_softplus")
ACTIVATIONS = ("swiglu", "geglu", "relu2")
BACKENDS = ("auto", "grouped_mm", "loop", "padded_bmm")
DROP_POLICIES = ("position", "score")
PRECISIONS = ("bf16", "mxfp8", "fp8_blockwise", "nvfp4", "mxfp4")
# Low-precision expert GEMMs split both widths (d_model and d_expert) into whole weight blocks
# (ops/quant_gemm.py check_widths; tests/test_config_combos.py keeps this table equal to it).
PRECISION_WIDTH_BLOCK = {"mxfp8": 32, "fp8_blockwise": 128, "nvfp4": 16, "mxfp4": 32}
STRATEGIES = ("token_choice", "expert_choice", "expert_threshold", "hash", "forced_balance")
BIAS_RULES = ("sign", "proportional", "adaptive")  # loss-free bias rules (layers/balance.py bias_update)
BIAS_RATE_SCHEDULES = ("constant", "lr")  # how the bias step u changes over the run (balance.bias_rate_scale)


@dataclass
class RouterConfig:
    """How scores are computed and experts selected (mission.md section 2)."""

    score_func: str = "softmax"
    # Softmax over all E logits before top-k. Post-softmax (softmax over the k picked logits) with k=1
    # always gives weight 1 and no router gradient, so that combination is refused.
    pre_softmax: bool = True
    renormalize: bool = True  # rescale the k weights to sum to 1
    scaling_factor: float = 1.0  # multiplies the final weights (about 2.5 in DeepSeek-V3 style)
    n_groups: int = 1  # group-limited routing: experts form n_groups groups ...
    topk_groups: int = 1  # ... and only the best topk_groups groups are eligible
    use_expert_bias: bool = False  # selection-only bias buffer (loss-free balancing)
    # Who chooses (mission.md section 2): token_choice (top-k per token), expert_choice (each expert
    # takes its top-C tokens; leaks future tokens, so not for autoregressive inference),
    # expert_threshold (a token goes to every expert whose score beats a threshold learned from
    # previous batches), hash (fixed table from token id), forced_balance (uniform random, balanced
    # to within one pair per expert: the balanced ceiling for benchmarks).
    strategy: str = "token_choice"
    expert_capacity_factor: float = 1.0  # expert_choice: C = ceil(factor * T * top_k / E)
    threshold_momentum: float = 0.99  # expert_threshold: EMA of the per-expert score quantile
    max_experts_per_token: Optional[int] = None  # expert_threshold: slots per token (None = E, exact)
    hash_buckets: int = 4096  # hash: table rows; token id modulo this picks the row
    # Serving with fewer experts (docs/serving.md): run the top top_k experts but normalise their
    # weights over the top norm_top_k (>= top_k), as if routing top norm_top_k and dropping the rest.
    # None = top_k (the usual rule). token_choice only; needs weights that are normalised at all.
    # Set, it normalises even over one expert (weight = scaling_factor, no router gradient).
    norm_top_k: Optional[int] = None

    def validate(self, prefix: str, num_experts: int, top_k: int, experts: str = "") -> None:
        """`num_experts`: what the router chooses among; `experts` names where that count comes from
        (default: the sibling field num_experts), so a message names both fields of a combination."""
        moe = prefix.rpartition(".")[0]  # the MoE section around the router: its top_k, num_experts
        moe = f"{moe}." if moe else ""
        experts = experts or f"{moe}num_experts={num_experts}"
        _choice(f"{prefix}.score_func", self.score_func, SCORE_FUNCS)
        _choice(f"{prefix}.strategy", self.strategy, STRATEGIES)
        if not self.expert_capacity_factor > 0:
            _fail(f"{prefix}.expert_capacity_factor", self.expert_capacity_factor, "must be > 0")
        if not 0.0 <= self.threshold_momentum < 1.0:
            _fail(f"{prefix}.threshold_momentum", self.threshold_momentum, "must be in [0, 1)")
        if self.max_experts_per_token is not None:
            _positive(f"{prefix}.max_experts_per_token", self.max_experts_per_token)
            if self.max_experts_per_token > num_experts:
                _fail(f"{prefix}.max_experts_per_token", self.max_experts_per_token, f"exceeds {experts}")
        _positive(f"{prefix}.hash_buckets", self.hash_buckets)
        if self.use_expert_bias and self.strategy != "token_choice":
            # The bias only enters token-choice top-k: expert choice is balanced by construction,
            # expert_threshold's thresholds already are per-expert biases, hash and forced_balance
            # ignore the router's choice. A bias there would be a buffer that silently does nothing.
            _fail(f"{prefix}.use_expert_bias", self.use_expert_bias,
                  f"only acts with {prefix}.strategy='token_choice' (got {self.strategy!r})")
        _positive(f"{prefix}.n_groups", self.n_groups)
        _positive(f"{prefix}.topk_groups", self.topk_groups)
        if self.topk_groups > self.n_groups:
            _fail(f"{prefix}.topk_groups", self.topk_groups, f"exceeds n_groups={self.n_groups}")
        if num_experts % self.n_groups:
            _fail(f"{prefix}.n_groups", self.n_groups, f"does not divide {experts}")
        per_group = num_experts // self.n_groups
        if top_k > self.topk_groups * per_group:
            _fail(f"{prefix}.topk_groups", self.topk_groups,
                  f"leaves {self.topk_groups * per_group} eligible experts, fewer than {moe}top_k={top_k}")
        if self.norm_top_k is not None:
            self._validate_norm_top_k(prefix, num_experts, top_k, self.topk_groups * per_group, moe, experts)
        # (norm_top_k=1 gives the constant weight 1 on purpose: the serving "kept" rule at one expert)
        if self.score_func == "softmax" and top_k == 1 and self.norm_top_k is None and not self.pre_softmax:
            _fail(f"{prefix}.pre_softmax", self.pre_softmax,
                  f"softmax with {moe}top_k=1 needs pre_softmax=True (post-softmax over one logit is constant 1: "
                  "no router gradient)")
        if not self.scaling_factor > 0:
            _fail(f"{prefix}.scaling_factor", self.scaling_factor, "must be > 0")

    def _validate_norm_top_k(self, prefix: str, num_experts: int, top_k: int, eligible: int, moe: str,
                             experts: str) -> None:
        name, k2 = f"{prefix}.norm_top_k", self.norm_top_k
        _positive(name, k2)
        if self.strategy != "token_choice":
            # the other strategies pick a variable or imposed set of experts: there is no ranked
            # top-k2 list whose mass would be the denominator
            _fail(name, k2, f"only acts with {prefix}.strategy='token_choice' (got {self.strategy!r})")
        if k2 < top_k:
            _fail(name, k2, f"is below {moe}top_k={top_k} (the weights of the top_k run experts are "
                  "normalised over the top norm_top_k, which must include them)")
        if k2 > num_experts:
            _fail(name, k2, f"exceeds {experts}")
        if k2 > eligible:
            _fail(name, k2, f"exceeds the {eligible} experts group-limited routing leaves eligible "
                  f"({prefix}.topk_groups={self.topk_groups} of {prefix}.n_groups={self.n_groups})")
        if not self.renormalize and not (self.score_func == "softmax" and not self.pre_softmax):
            # the weights are the raw scores: nothing is normalised, so norm_top_k would do nothing
            _fail(name, k2, "needs normalised weights: with renormalize=false (and no post-softmax) "
                  f"the weights are the raw {self.score_func} scores, so there is nothing to normalise "
                  "(leave norm_top_k unset)")


@dataclass
class BalanceConfig:
    """Load-balancing losses and rules (mission.md section 3)."""

    # Switch aux losses by scope; any combination, each with its coefficient (0 = off):
    aux_loss_coeff: float = 0.01  # micro-batch: f and P from the same micro-batch
    seq_aux_loss_coeff: float = 0.0  # sequence: per sequence, averaged
    # global batch: f summed over the step's micro-batches and data-parallel ranks (the trainer forms
    # it, layers/balance.py); keeps domain specialisation that a micro-batch loss fights
    global_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 1e-3  # router z-loss: mean(logsumexp(logits)^2)
    bias_update_rate: float = 0.0  # loss-free bias step u (0 = off); needs router.use_expert_bias
    # sign: b += u * sign(mean - load) (DeepSeek-V3); proportional: b += u * (mean - load) / mean,
    # a step that scales with the relative violation; adaptive: the sign rule with a per-expert step
    # that starts at u, grows while an expert's violation keeps its sign and halves when it flips
    # (layers/balance.py bias_update, adaptive_bias_update)
    bias_update_rule: str = "sign"
    # constant: u all run long; lr: u times lr(step) / lr once the lr's warm-up is over, so the bias
    # settles as the lr decays instead of pushing tokens across margins at full step while the model
    # converges (DeepSeek-V3 stops its bias updates for the last part of training; this decays them)
    bias_rate_schedule: str = "constant"
    # warm start: the first n optimizer steps set the bias by quantile balancing (outright, each
    # step), then bias_update_rule takes over from there (0 = off; needs bias_update_rate > 0)
    bias_warm_start_steps: int = 0
    # Quantile balancing: set the bias each step from the score distribution (layers/balance.py).
    quantile_balance: bool = False
    # quantile balancing's damping: b <- m * b + (1 - m) * q (0 = set to q outright each step)
    quantile_momentum: float = 0.0

    def validate(self, prefix: str) -> None:
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "global_aux_loss_coeff", "z_loss_coeff",
                     "bias_update_rate"):
            value = getattr(self, name)
            if not value >= 0:
                _fail(f"{prefix}.{name}", value, "must be >= 0")
        if self.quantile_balance and self.bias_update_rate > 0:
            _fail(f"{prefix}.quantile_balance", self.quantile_balance,
                  "and bias_update_rate > 0 both write the expert bias; choose one")
        _choice(f"{prefix}.bias_update_rule", self.bias_update_rule, BIAS_RULES)
        _choice(f"{prefix}.bias_rate_schedule", self.bias_rate_schedule, BIAS_RATE_SCHEDULES)
        if self.bias_rate_schedule != "constant" and not self.bias_update_rate > 0:
            _fail(f"{prefix}.bias_rate_schedule", self.bias_rate_schedule,
                  "needs bias_update_rate > 0: it scales that step")
        w = self.bias_warm_start_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            _fail(f"{prefix}.bias_warm_start_steps", w, "must be an integer >= 0 (0 = off)")
        if w and not self.bias_update_rate > 0:
            _fail(f"{prefix}.bias_warm_start_steps", w,
                  "needs bias_update_rate > 0: the rate rule takes over after the warm start")
        if not 0.0 <= self.quantile_momentum < 1.0:
            _fail(f"{prefix}.quantile_momentum", self.quantile_momentum, "must be in [0, 1)")
        if self.quantile_momentum > 0 and not self.quantile_balance:
            _fail(f"{prefix}.quantile_momentum", self.quantile_momentum, "needs quantile_balance=true")


@dataclass
class MoEConfig:
    """One MoE layer: router, experts, dispatch mode."""

    _name = "moe"  # the prefix its own validation messages use

    num_experts: int = 8
    top_k: int = 2
    d_expert: int = 128  # f: hidden width of one routed expert
    activation: str = "swiglu"
    act_clamp: Optional[float] = None  # hard clamp of the activation input (e.g. 10)
    act_softcap: Optional[float] = None  # smooth cap: c * tanh(x / c)
    n_shared_experts: int = 0
    d_shared: int = 0  # width of each shared expert (0 = d_expert)
    backend: str = "auto"  # grouped GEMM backend, chosen once at build
    align: int = 1  # per-expert row alignment of the routing plan (1 on CPU; 8..128 on GPU/low precision)
    capacity_factor: Optional[float] = None  # None = dropless; a number = capacity baseline
    drop_policy: str = "position"  # capacity mode: which pairs survive ("position" or "score")
    precision: str = "bf16"  # expert GEMMs: bf16 or a low-precision format (see ops/quant.py)
    # zero-compute experts (layers/identity.py): routed like any expert, they return their input
    n_identity_experts: int = 0
    latent_dim: int = 0  # LatentMoE (layers/latent.py): experts run in this width l (0 = off, l <= d)
    latent_norm: bool = False  # RMSNorm of the latent rows before dispatch
    router: RouterConfig = field(default_factory=RouterConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)

    def __post_init__(self) -> None:
        self.validate("moe")

    def validate(self, prefix: str = "moe") -> None:
        _positive(f"{prefix}.num_experts", self.num_experts)
        _positive(f"{prefix}.top_k", self.top_k)
        for name in ("n_identity_experts", "latent_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(f"{prefix}.{name}", v, "must be an integer >= 0 (0 = off)")
        if not isinstance(self.latent_norm, bool):
            _fail(f"{prefix}.latent_norm", self.latent_norm, "must be true or false")
        if self.latent_norm and not self.latent_dim:
            _fail(f"{prefix}.latent_norm", True, "needs latent_dim > 0 (the norm is at the latent input)")
        if self.n_identity_experts and self.capacity_factor is not None:
            _fail(f"{prefix}.n_identity_experts", self.n_identity_experts,
                  f"needs the dropless path ({prefix}.capacity_factor=None, not {self.capacity_factor}): identity "
                  "pairs leave the plan as invalid slots, which the capacity layout does not take")
        selectable = ExpertSlots.from_config(self).selectable
        if self.top_k > selectable:
            _fail(f"{prefix}.top_k", self.top_k, f"exceeds num_experts={self.num_experts}"
                  + (f" + n_identity_experts={self.n_identity_experts}" if self.n_identity_experts else ""))
        _positive(f"{prefix}.d_expert", self.d_expert)
        _choice(f"{prefix}.activation", self.activation, ACTIVATIONS)
        for name in ("act_clamp", "act_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                _fail(f"{prefix}.{name}", value, "must be > 0 or None")
        if self.n_shared_experts < 0:
            _fail(f"{prefix}.n_shared_experts", self.n_shared_experts, "must be >= 0")
        if self.d_shared < 0:
            _fail(f"{prefix}.d_shared", self.d_shared, "must be >= 0")
        _choice(f"{prefix}.backend", self.backend, BACKENDS)
        _positive(f"{prefix}.align", self.align)
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            _fail(f"{prefix}.capacity_factor", self.capacity_factor, "must be > 0 (or None for dropless)")
        if self.backend == "padded_bmm" and self.capacity_factor is None:
            _fail(f"{prefix}.backend", self.backend,
                  "padded_bmm is the capacity layout; set capacity_factor, or use grouped_mm for dropless")
        _choice(f"{prefix}.drop_policy", self.drop_policy, DROP_POLICIES)
        _choice(f"{prefix}.precision", self.precision, PRECISIONS)
        if isinstance(self.router, dict):
            self.router = RouterConfig(**self.router)
        if isinstance(self.balance, dict):
            self.balance = BalanceConfig(**self.balance)
        experts = f"{prefix}.num_experts={self.num_experts}" + (
            f" + {prefix}.n_identity_experts={self.n_identity_experts}" if self.n_identity_experts else "")
        self.router.validate(f"{prefix}.router", selectable, self.top_k, experts)
        self.balance.validate(f"{prefix}.balance")
        if self.capacity_factor is not None and self.router.strategy in ("expert_choice", "expert_threshold"):
            # their routing has a validity mask (a variable number of experts per token); the capacity
            # plan takes exactly top_k experts per token (layers/dispatch.py)
            _fail(f"{prefix}.capacity_factor", self.capacity_factor,
                  f"the capacity baseline takes a fixed top_k per token; {prefix}.router.strategy="
                  f"{self.router.strategy!r} has a variable count (set capacity_factor=None)")
        if self.balance.bias_update_rate > 0 and not self.router.use_expert_bias:
            _fail(f"{prefix}.balance.bias_update_rate", self.balance.bias_update_rate,
                  "needs router.use_expert_bias=true")
        if self.balance.quantile_balance and not self.router.use_expert_bias:
            _fail(f"{prefix}.balance.quantile_balance", True, "needs router.use_expert_bias=true")
        r = self.router
        if (self.balance.bias_update_rate >= 1.0 / selectable and r.score_func == "softmax"
                and r.pre_softmax):
            # Selection is on softmax probabilities, whose mean is 1/E: a sign step that large moves
            # an expert across every other expert's scores at once, so the loads flip wholesale from
            # step to step instead of converging. (Post-softmax selects on logits, where the bias is
            # in logit units and this bound does not apply.)
            _fail(f"{prefix}.balance.bias_update_rate", self.balance.bias_update_rate,
                  f"must be < 1/num_experts={1.0 / selectable:.3g} with softmax (pre-softmax) "
                  "scores: one step would outweigh the mean probability and the loads oscillate")

    @property
    def shared_width(self) -> int:
        return self.n_shared_experts * (self.d_shared or self.d_expert)
