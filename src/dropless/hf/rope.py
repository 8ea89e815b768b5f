"""The rotary of a config.json, in both spellings transformers has used: read on import, written on export.

transformers 4.x reads a top-level `rope_theta` (where absent, the class default: 1e6 for Mixtral,
1e4 for the others) and `rope_scaling` (null, or a dict with `rope_type` or `type` and the scaling's
own keys). transformers 5 reads `rope_parameters` ({rope_type, rope_theta, ...}), except that a
non-null `rope_scaling` takes its place (with the top-level `rope_theta` filled in), so a 4.x file
still loads. 4.x ignores `rope_parameters`: a file with only that key (what 5.x's save_pretrained
writes) loads in 4.x with the default theta and no scaling, another model.

Export writes all three keys, `rope_theta`, `rope_scaling` (null for the plain rotary, else the
scaling's dict without the theta) and `rope_parameters`, so that every version reads the trained
rotary (tests/test_hf_parity.py checks the keys 4.x reads).

Import reads what transformers 5 reads. A file that has 4.x keys beside `rope_parameters` must say
the same thing in both, else the versions compute different models and the file is refused, naming
both. Anything dropless does not represent is refused by name: a partial rotary, per-layer-type
rotaries, an explicit YaRN `attention_factor`, scalings other than YaRN (and YaRN outside
DeepSeek-V3, which check_exportable keeps plain too).
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, YarnConfig
from .defaults import Fields, refuse

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_PLAIN_KEYS = ("rope_type", "type", "rope_theta")


def _parse(p: dict[str, Any], theta: Any, where: str, max_pos: int, yarn_ok: bool) -> tuple[float, YarnConfig]:
    """(theta, yarn) of one rotary dict `p` (found at config.json key `where`)."""
    if not isinstance(p, dict):
        refuse(where, p, "a dict of rotary settings")
    kind = p.get("rope_type", p.get("type", "default"))
    if "rope_type" in p and "type" in p and p["type"] != kind:
        refuse(f"{where}.type", p["type"], f"disagrees with {where}.rope_type={kind!r}")
    if kind not in ("default", "yarn") or (kind == "yarn" and not yarn_ok):
        refuse(f"{where}.rope_type", kind, "only the plain rotary ('default')" + (" or 'yarn'" if yarn_ok else ""))
    allowed = _PLAIN_KEYS + (YARN_KEYS + ("truncate",) if kind == "yarn" else ())
    for k, v in p.items():
        if k not in allowed:
            refuse(f"{where}.{k}", v, f"not supported with rope_type {kind!r} (dropless reads {', '.join(allowed)})")
    if theta is None or isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        refuse(f"{where}.rope_theta" if "rope_theta" in p else "rope_theta", theta, "a positive number")
    if kind == "default":
        return float(theta), YarnConfig()
    if p.get("truncate", True) is not True:
        refuse(f"{where}.truncate", p["truncate"], "only the truncated correction range")
    # both versions: an absent original context is max_position_embeddings, an absent factor their ratio
    original = p.get("original_max_position_embeddings") or max_pos
    yarn = YarnConfig(factor=float(p.get("factor") or max_pos / original), original_max_seq_len=int(original),
                      beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                      mscale=float(p.get("mscale") or 0), mscale_all_dim=float(p.get("mscale_all_dim") or 0))
    return float(theta), yarn


def read(fields: Fields, yarn_ok: bool = False) -> tuple[float, YarnConfig]:
    """The rotary base and YaRN settings of a config.json (module note)."""
    hf = fields.hf
    if "partial_rotary_factor" in hf:
        refuse("partial_rotary_factor", hf["partial_rotary_factor"], "a partial rotary is not supported")
    max_pos = fields("max_position_embeddings")
    theta = fields("rope_theta")
    scaling, params = fields("rope_scaling"), fields("rope_parameters")
    v4 = _parse(scaling or {}, theta, "rope_scaling", max_pos, yarn_ok)  # what 4.x reads
    if scaling:  # what 5.x reads: rope_scaling when set (its own theta first)
        v5 = _parse(scaling, scaling.get("rope_theta", theta), "rope_scaling", max_pos, yarn_ok)
        if v5 != v4:
            refuse("rope_scaling.rope_theta", scaling["rope_theta"], f"disagrees with rope_theta={theta!r} "
                   "(transformers 4.x reads rope_theta, 5.x rope_scaling.rope_theta)")
    if params is None:
        return v4
    vp = _parse(params, params.get("rope_theta", theta), "rope_parameters", max_pos, yarn_ok)
    if ("rope_theta" in fields or scaling) and vp != v4:
        refuse("rope_parameters", params, f"disagrees with rope_theta={theta!r} and rope_scaling={scaling!r}: "
               "transformers 4.x reads those, 5.x reads rope_parameters (or a non-null rope_scaling), "
               "so the versions would compute different models")
    return v4 if scaling else vp


def hf_keys(cfg: ModelConfig) -> dict[str, Any]:
    """`rope_theta`, `rope_scaling` and `rope_parameters` of an exported config.json (module note)."""
    y = cfg.rope_yarn
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if y.factor != 1.0:
        params = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": y.factor,
                  "original_max_position_embeddings": y.original_max_seq_len, "beta_fast": y.beta_fast,
                  "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim}
    scaling = None if y.factor == 1.0 else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": params}
