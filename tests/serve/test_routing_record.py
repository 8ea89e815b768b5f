"""Routing records: the file round trip, replay through it reproducing the recording forward exactly,
and the reader refusing files that are not whole records."""

from __future__ import annotations

import struct

import pytest
import torch

from dropless.model import MoEModel
from dropless.serve.record_routing import record
from dropless.data.routing_record import FORMAT_VERSION, MAGIC, RoutingRecord
from tiny_run import tiny

# 3 blocks: block 0 dense, blocks 1 and 2 MoE (E=4, K=2): the layer order in the header is [1, 2].
CFG = ["model.n_layers=3", "model.moe.router.use_expert_bias=true"]


def tiny_model(*extra: str) -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(tiny(*CFG, *extra).model).eval()


def sequences(lengths: list[int], vocab: int = 256, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def test_replay_through_the_file_equals_the_recording_forward(tmp_path) -> None:
    model = tiny_model()
    # A non-zero expert bias: selection (biased) and weights (unbiased scores) differ, so replay must
    # take the weights from the router's scores at the ids, as the recording forward did.
    for i, layer in enumerate(model.moe_layers()):
        layer.router.set_bias(torch.tensor([0.3, -0.2, 0.1, 0.0]) * (i + 1))
    seqs = sequences([32, 17, 5])
    rec = record(model, seqs, "fp32", "some/run", step=7, progress=False)
    assert rec.moe_layers == [1, 2] and rec.source == "full forward fp32"
    rec.save(tmp_path / "r.rec")
    back = RoutingRecord.load(tmp_path / "r.rec")
    assert back.model["step"] == 7 and back.model["run_dir"] == "some/run"
    assert back.model["config_hash"] == rec.model["config_hash"]
    for tok, ids_LSK in zip(back.tokens, back.ids):
        with torch.no_grad():
            free = model(tok[None])
            replayed = model(tok[None], replay_ids=[ids[None] for ids in ids_LSK])
        for layer_ids, f, r in zip(ids_LSK, free.moe, replayed.moe):
            assert torch.equal(f.ids_TK, layer_ids)  # the file holds what the forward chose
            assert torch.equal(r.ids_TK, layer_ids)
        assert torch.equal(free.logits, replayed.logits)


def test_round_trip_keeps_every_field_and_picks_compact_dtypes(tmp_path) -> None:
    # E = 300 > 256: ids need int16; vocab 1000: tokens int32; R < S for one sequence (a sampler
    # never routes its last sampled token); an empty sequence.
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 4, 0)]
    ids = [torch.randint(0, 300, (3, r, 2), generator=g) for r in (8, 4, 0)]
    rec = RoutingRecord(tokens, ids, [0, 2, 5], 2, 300, 1000, "kv-cache decode bf16",
                        {"run_dir": "r", "config_hash": "abc", "step": None})
    head = rec.header()
    assert (head["id_dtype"], head["token_dtype"]) == ("int16", "int32")
    rec.save(tmp_path / "a.rec")
    back = RoutingRecord.load(tmp_path / "a.rec")
    assert (back.moe_layers, back.top_k, back.num_experts, back.vocab_size, back.source, back.model) == (
        [0, 2, 5], 2, 300, 1000, "kv-cache decode bf16", {"run_dir": "r", "config_hash": "abc", "step": None})
    for a, b in zip(tokens + ids, back.tokens + back.ids):
        assert torch.equal(a, b)
    # E <= 256 and a byte vocabulary: one byte per id and per token
    small = RoutingRecord([torch.arange(10)], [torch.zeros(1, 10, 2, dtype=torch.long)], [1], 2, 8, 256, "x")
    assert (small.header()["id_dtype"], small.header()["token_dtype"]) == ("uint8", "uint8")
    assert len(small.to_bytes()) < 16 + 400 + 10 + 20


def test_reader_refuses_truncated_foreign_and_damaged_files(tmp_path) -> None:
    rec = RoutingRecord(sequences([20, 12]), [torch.randint(0, 4, (2, n, 2)) for n in (20, 12)],
                        [1, 2], 2, 4, 256, "full forward fp32")
    data = rec.to_bytes()
    path = tmp_path / "x.rec"
    path.write_bytes(data[:-7])
    with pytest.raises(ValueError, match="truncated routing record"):
        RoutingRecord.load(path)
    path.write_bytes(data[:30])  # cut inside the header
    with pytest.raises(ValueError, match="truncated routing record"):
        RoutingRecord.load(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(ValueError, match="over-long"):
        RoutingRecord.load(path)
    torch.save({"ids": torch.zeros(3)}, path)  # a foreign file
    with pytest.raises(ValueError, match="not a dropless routing record"):
        RoutingRecord.load(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a dropless routing record"):
        RoutingRecord.load(path)
    path.write_bytes(struct.pack("<8sII", MAGIC, FORMAT_VERSION + 1, 0))
    with pytest.raises(ValueError, match=f"format version {FORMAT_VERSION + 1}"):
        RoutingRecord.load(path)
    flipped = bytearray(data)
    flipped[-1] ^= 1  # one id changed: same length, the CRC catches it
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="CRC-32"):
        RoutingRecord.load(path)
    with pytest.raises(FileNotFoundError):
        RoutingRecord.load(tmp_path / "missing.rec")


def test_record_refuses_inconsistent_contents() -> None:
    tok = [torch.arange(5)]
    with pytest.raises(ValueError, match="K=2"):
        RoutingRecord(tok, [torch.zeros(2, 5, 3, dtype=torch.long)], [1, 2], 2, 4, 256, "x")
    with pytest.raises(ValueError, match="only 5 tokens"):
        RoutingRecord(tok, [torch.zeros(2, 6, 2, dtype=torch.long)], [1, 2], 2, 4, 256, "x")
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        RoutingRecord(tok, [torch.full((2, 5, 2), 4)], [1, 2], 2, 4, 256, "x")


def test_check_model_names_the_mismatched_field() -> None:
    model = tiny_model()
    rec = RoutingRecord.for_model(model, [torch.arange(4)], [torch.zeros(2, 4, 2, dtype=torch.long)], "x")
    rec.check_model(model.cfg, model.expert_slots())
    for override, field in (("model.moe.top_k=1", "top_k"), ("model.moe.num_experts=8", "num_experts"),
                            ("model.n_layers=4", "moe_layers"), ("model.n_dense_layers=0", "moe_layers"),
                            ("model.vocab_size=512", "vocab_size")):
        other = tiny_model(override)
        with pytest.raises(ValueError, match=f"header field {field}="):
            rec.check_model(other.cfg, other.expert_slots())
