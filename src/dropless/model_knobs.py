"""Validation and layout rules of the model's design knobs (docs/model_knobs.md).

Kept out of config.py (which lists the fields) because each knob has a rule worth reading:

- `model.moe_layer_freq` with `model.n_dense_layers`: the first `n_dense_layers` layers are always
  dense. After that prefix an integer n makes every n-th layer MoE, counted from the first layer
  after the prefix (layers p, p + n, p + 2n, ... with p = n_dense_layers; the layers between use the
  dense MLP), so n = 1 is today's layout and changing the prefix shifts the pattern with it. A list
  names the MoE layers explicitly; it must be strictly increasing, inside [n_dense_layers, n_layers):
  a list entry inside the dense prefix is refused rather than silently ignored. (DeepSeek-V3 counts
  `layer % freq == 0` from layer 0; the two agree when the prefix is a multiple of n.)
- `model.block`: "sequential" is x + attn(norm(x)) then + ffn(norm(x)); "parallel_moe" (ScMoE's
  shortcut) feeds an MoE block's expert layer its own norm of the block's input x, so the MoE does not
  wait for attention (model.py Block, docs/model_knobs.md). Dense blocks stay sequential.
- `model.mtp_depth` / `model.mtp_weight` / `model.mtp_block`: multi-token prediction (layers/mtp.py);
  `mtp_block` "dense" gives each module a dense block, "moe" an MoE block (DeepSeek-V3's), whose
  balancing losses join the model's and whose router buffers the trainer's rules move with the main
  layers' (train/health.py). The global-batch aux loss counts the whole step's tokens in a no-grad
  pre-pass that never runs the MTP modules, so it is refused with an MoE block rather than applied
  to the main layers alone.
- `model.moe.latent_dim` must not exceed d_model (the MoE part checks l >= 0 itself).
"""

from __future__ import annotations

from typing import Any

from .configtree import _choice, _fail

BLOCKS = ("sequential", "parallel_moe")
MTP_BLOCKS = ("dense", "moe")


def moe_layer_ids(n_layers: int, n_dense_layers: int, freq: int | list[int]) -> tuple[int, ...]:
    if isinstance(freq, int):
        return tuple(range(n_dense_layers, n_layers, freq))
    return tuple(freq)


def moe_layout(n_layers: int, moe: list[int]) -> tuple[int, int | list[int]]:
    """The inverse of moe_layer_ids: the MoE layers `moe` (increasing) as (n_dense_layers,
    moe_layer_freq): the dense prefix, then 1 when every later layer is MoE, else the list."""
    prefix = moe[0] if moe else n_layers
    return prefix, (1 if list(moe) == list(range(prefix, n_layers)) else list(moe))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model_knobs(cfg: Any) -> None:
    """Raise ValueError naming the field and value (cfg: a ModelConfig)."""
    f = "model.moe_layer_freq"
    freq = cfg.moe_layer_freq
    if isinstance(freq, tuple):
        freq = cfg.moe_layer_freq = list(freq)
    if _int(freq):
        if freq < 1:
            _fail(f, freq, "must be a positive integer (every n-th layer) or a list of layer indices")
    elif isinstance(freq, list):
        if not all(_int(i) for i in freq):
            _fail(f, freq, "a list must hold layer indices (integers)")
        if any(b <= a for a, b in zip(freq, freq[1:])):
            _fail(f, freq, "a list must be strictly increasing")
        if freq and (freq[0] < cfg.n_dense_layers or freq[-1] >= cfg.n_layers):
            _fail(f, freq, f"list entries must be in [n_dense_layers={cfg.n_dense_layers}, "
                  f"n_layers={cfg.n_layers}): the first n_dense_layers layers are dense")
    else:
        _fail(f, freq, "must be a positive integer (every n-th layer) or a list of layer indices")
    _choice("model.block", cfg.block, BLOCKS)
    if not _int(cfg.mtp_depth) or cfg.mtp_depth < 0:
        _fail("model.mtp_depth", cfg.mtp_depth, "must be an integer >= 0 (0 = off)")
    if cfg.mtp_depth >= cfg.max_seq_len:
        _fail("model.mtp_depth", cfg.mtp_depth, f"must be < max_seq_len={cfg.max_seq_len}")
    if isinstance(cfg.mtp_weight, bool) or not isinstance(cfg.mtp_weight, (int, float)) \
            or not cfg.mtp_weight >= 0:
        _fail("model.mtp_weight", cfg.mtp_weight, "must be a number >= 0")
    _choice("model.mtp_block", cfg.mtp_block, MTP_BLOCKS)
    if cfg.mtp_block == "moe" and cfg.mtp_depth and cfg.moe.balance.global_aux_loss_coeff > 0:
        _fail("model.mtp_block", cfg.mtp_block, "the global-batch aux loss "
              f"(model.moe.balance.global_aux_loss_coeff={cfg.moe.balance.global_aux_loss_coeff}) counts "
              "the step's tokens without running the MTP modules: use mtp_block=\"dense\" or the "
              "micro-batch / sequence aux loss")
    if cfg.moe.latent_dim > cfg.d_model:
        _fail("model.moe.latent_dim", cfg.moe.latent_dim, f"must be <= d_model={cfg.d_model} "
              "(the experts run in the projected-down width)")
