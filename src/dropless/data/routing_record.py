"""Routing records: which experts every MoE layer chose for every token of a set of sequences.

Legend: L MoE layers (in block order), S tokens of a sequence, R tokens of it that went through the
model (R <= S: a sampler never feeds its last sampled token), K experts per token, E the range of the
ids: the experts the router selects among (routed, then identity experts: expert_slots.py).

What routing replay (R3) needs from a rollout engine: per sequence the tokens and, for every MoE
layer and every routed token, the K expert ids it chose; the trainer then forces those ids
(`model(tokens, targets, replay_ids=...)`) and takes only the weights from its own router. The same
records feed `dropless routing-mismatch`, which compares two engines' choices on the same tokens.

File layout (little-endian throughout):

    magic      8 bytes   b"DLROUTE\\n"
    version    uint32    FORMAT_VERSION
    header_len uint32    bytes of the JSON header that follows
    header     JSON      model (run_dir, config_hash, step), source (the path and dtype that routed,
                         e.g. "full forward fp32", "kv-cache decode bf16"), moe_layers (block indices,
                         in the order of the ids' L axis), top_k, num_experts (E, the id range),
                         identity_experts (how many of the E are identity experts, the last ones;
                         written only when > 0), vocab_size, token_dtype, id_dtype,
                         sequences [[S, R], ...], body_bytes, body_crc32
    body       per sequence: tokens [S] (token_dtype), then ids [L, R, K] (id_dtype), C order

Ids are uint8 when E <= 256 (the common case: one byte per choice), int16 up to 32768, else int32;
tokens uint8 for byte vocabularies, else int32. The body's length and CRC-32 are in the header, so a
truncated or damaged file is refused instead of read as shifted ids.

`config_hash` is a short hash of the model fields that define the network and how it routes (the
fields a resumed run may not change, runs/resume.py): two runs' records share it exactly when their
ids mean the same experts of the same architecture. The trainer checks the fields it needs (layers,
K, E, identity experts, vocabulary) by name; the hash and step are for people tracing which policy
produced a record.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .. import atomic
from ..config import ModelConfig, to_dict
from ..expert_slots import ExpertSlots
from ..model import MoEModel

MAGIC = b"DLROUTE\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_DTYPES = {"uint8": np.dtype("<u1"), "int16": np.dtype("<i2"), "int32": np.dtype("<i4")}
# strategies whose decision has a variable number of experts per token (valid_TK): K slots do not
# mean K choices, and replay imposes K choices per token, so they are not recorded
VARIABLE_COUNT_STRATEGIES = ("expert_choice", "expert_threshold")


def id_dtype(num_experts: int) -> str:
    return "uint8" if num_experts <= 256 else "int16" if num_experts <= 2**15 else "int32"


def token_dtype(vocab_size: int) -> str:
    return "uint8" if vocab_size <= 256 else "int32"


def config_hash(cfg: ModelConfig) -> str:
    """16 hex digits of sha256 over the model fields a resumed run may not change (fixed_fields.is_fixed)."""
    from ..fixed_fields import flatten, is_fixed

    fixed = {k: v for k, v in flatten(to_dict(cfg), "model.").items() if is_fixed(k)}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def moe_layer_indices(cfg: ModelConfig) -> list[int]:
    """Block indices of the MoE layers, in the order `model(...).moe` returns them."""
    return list(cfg.moe_layer_ids)


@dataclass
class RoutingRecord:
    """Sequences with their routing. `tokens[i]`: [S_i] int64; `ids[i]`: [L, R_i, K] int64, the
    choices for the first R_i <= S_i tokens."""

    tokens: list[torch.Tensor]
    ids: list[torch.Tensor]
    moe_layers: list[int]
    top_k: int
    num_experts: int  # E: the id range, every selectable expert (identity experts included)
    vocab_size: int
    source: str
    model: dict[str, Any] = field(default_factory=dict)  # run_dir, config_hash, step
    identity_experts: int = 0  # how many of the E are identity experts (ids E - this .. E - 1)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.ids):
            raise ValueError(f"RoutingRecord: {len(self.tokens)} token sequences but {len(self.ids)} id tensors")
        L, K = len(self.moe_layers), self.top_k
        if K < 1 or self.num_experts < 1 or self.vocab_size < 1:
            raise ValueError(f"RoutingRecord: top_k={K}, num_experts={self.num_experts}, "
                             f"vocab_size={self.vocab_size}: must all be >= 1")
        if not 0 <= self.identity_experts < self.num_experts:
            raise ValueError(f"RoutingRecord: identity_experts={self.identity_experts}: must be in "
                             f"[0, num_experts={self.num_experts})")
        self.tokens = [torch.as_tensor(t).long().cpu().reshape(-1) for t in self.tokens]
        self.ids = [torch.as_tensor(i).long().cpu() for i in self.ids]
        for n, (tok_S, ids_LRK) in enumerate(zip(self.tokens, self.ids)):
            if ids_LRK.dim() != 3 or ids_LRK.shape[0] != L or ids_LRK.shape[2] != K:
                raise ValueError(f"sequence {n}: ids of shape {tuple(ids_LRK.shape)}, expected "
                                 f"[L={L}, R, K={K}]")
            if ids_LRK.shape[1] > tok_S.numel():
                raise ValueError(f"sequence {n}: ids for {ids_LRK.shape[1]} tokens but only "
                                 f"{tok_S.numel()} tokens")
            if ids_LRK.numel() and (ids_LRK.min() < 0 or ids_LRK.max() >= self.num_experts):
                raise ValueError(f"sequence {n}: expert ids outside [0, {self.num_experts})")
            if tok_S.numel() and (tok_S.min() < 0 or tok_S.max() >= self.vocab_size):
                raise ValueError(f"sequence {n}: token ids outside [0, {self.vocab_size})")

    @classmethod
    def for_model(cls, model: MoEModel, tokens: Sequence[Any], ids: Sequence[torch.Tensor], source: str,
                  run_dir: str | Path = "", step: int | None = None) -> "RoutingRecord":
        """A record of `model`: per sequence its tokens (list or [S] tensor) and the ids
        [L_moe, R, K] of the R <= S tokens that went through the model (what
        `generate(..., record_routing=True)` returns per sequence), with the header filled in; the
        id range is the model's selectable experts (`model.expert_slots()`)."""
        cfg, slots = model.cfg, model.expert_slots()
        if cfg.moe.router.strategy in VARIABLE_COUNT_STRATEGIES:
            raise ValueError(f"model.moe.router.strategy={cfg.moe.router.strategy!r}: routing records "
                             "hold K choices per token; this strategy chooses a variable number")
        return cls(list(tokens), list(ids), moe_layer_indices(cfg), cfg.moe.top_k, slots.selectable,
                   cfg.vocab_size, source,
                   {"run_dir": str(run_dir), "config_hash": config_hash(cfg), "step": step},
                   identity_experts=slots.identity)

    def check_model(self, cfg: ModelConfig, slots: ExpertSlots, what: str = "record") -> None:
        """ValueError naming the first field where this record's header and the model (its config
        and its built layers' expert slots) differ."""
        expect = {"moe_layers": moe_layer_indices(cfg), "top_k": cfg.moe.top_k,
                  "num_experts": slots.selectable, "identity_experts": slots.identity,
                  "vocab_size": cfg.vocab_size}
        names = {"moe_layers": "model.n_layers / model.n_dense_layers", "top_k": "model.moe.top_k",
                 "num_experts": "model.moe.num_experts + model.moe.n_identity_experts",
                 "identity_experts": "model.moe.n_identity_experts", "vocab_size": "model.vocab_size"}
        for key, want in expect.items():
            got = getattr(self, key)
            if got != want:
                raise ValueError(f"{what}: header field {key}={got} does not match the model's "
                                 f"{names[key]} (expects {key}={want})")

    # --- file format -------------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        head = {"model": self.model, "source": self.source, "moe_layers": self.moe_layers,
                "top_k": self.top_k, "num_experts": self.num_experts, "vocab_size": self.vocab_size,
                "token_dtype": token_dtype(self.vocab_size), "id_dtype": id_dtype(self.num_experts),
                "sequences": [[t.numel(), i.shape[1]] for t, i in zip(self.tokens, self.ids)]}
        if self.identity_experts:  # absent otherwise: a record without identity experts keeps its bytes
            head["identity_experts"] = self.identity_experts
        return head

    def to_bytes(self) -> bytes:
        head = self.header()
        tdt, idt = _DTYPES[head["token_dtype"]], _DTYPES[head["id_dtype"]]
        body = b"".join(t.numpy().astype(tdt).tobytes() + i.numpy().astype(idt).tobytes()
                        for t, i in zip(self.tokens, self.ids))
        head["body_bytes"], head["body_crc32"] = len(body), zlib.crc32(body)
        text = json.dumps(head, sort_keys=True).encode()
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text + body

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file renamed into place): a reader never sees half a record."""
        return atomic.write_bytes(path, self.to_bytes(), fsync=True)

    @classmethod
    def load(cls, path: str | Path) -> "RoutingRecord":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such routing record")
        return cls.from_bytes(path.read_bytes(), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> "RoutingRecord":
        if len(data) < _PREFIX.size or data[:8] != MAGIC:
            raise ValueError(f"{name}: not a dropless routing record (it does not start with {MAGIC!r})")
        _, version, hlen = _PREFIX.unpack_from(data)
        if version != FORMAT_VERSION:
            raise ValueError(f"{name}: routing record format version {version}; this dropless reads "
                             f"version {FORMAT_VERSION}")
        if len(data) < _PREFIX.size + hlen:
            raise ValueError(f"{name}: truncated routing record (the header needs {hlen} bytes, "
                             f"{len(data) - _PREFIX.size} present)")
        try:
            head = json.loads(data[_PREFIX.size:_PREFIX.size + hlen])
            body = memoryview(data)[_PREFIX.size + hlen:]
            n_body, crc = int(head["body_bytes"]), int(head["body_crc32"])
            tdt, idt = _DTYPES[head["token_dtype"]], _DTYPES[head["id_dtype"]]
            L, K = len(head["moe_layers"]), int(head["top_k"])
            seqs = [(int(s), int(r)) for s, r in head["sequences"]]
            identity = int(head.get("identity_experts", 0))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{name}: damaged routing record header ({err})") from None
        if len(body) != n_body:
            kind = "truncated" if len(body) < n_body else "over-long"
            raise ValueError(f"{name}: {kind} routing record: the body should hold {n_body} bytes, "
                             f"the file has {len(body)}")
        if zlib.crc32(body) != crc:
            raise ValueError(f"{name}: damaged routing record: body CRC-32 mismatch")
        expected = sum(S * tdt.itemsize + L * R * K * idt.itemsize for S, R in seqs)
        if expected != n_body:
            raise ValueError(f"{name}: damaged routing record: the sequences need {expected} bytes, "
                             f"the header says {n_body}")
        tokens, ids, at = [], [], 0
        for S, R in seqs:
            tokens.append(torch.from_numpy(np.frombuffer(body, tdt, S, at).astype(np.int64)))
            at += S * tdt.itemsize
            ids.append(torch.from_numpy(np.frombuffer(body, idt, L * R * K, at).astype(np.int64))
                       .view(L, R, K))
            at += L * R * K * idt.itemsize
        return cls(tokens, ids, [int(b) for b in head["moe_layers"]], K, int(head["num_experts"]),
                   int(head["vocab_size"]), str(head["source"]), dict(head.get("model") or {}), identity)

    def fingerprint(self) -> str:
        """sha256 of the serialized record (16 hex digits): what a resumed replay run compares."""
        return hashlib.sha256(self.to_bytes()).hexdigest()[:16]
