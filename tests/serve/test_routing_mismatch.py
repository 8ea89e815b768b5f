"""`dropless routing-mismatch`: the metric on hand-made records whose answers are worked out by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dropless.serve.mismatch import main, routing_mismatch
from dropless.data.routing_record import RoutingRecord


def rec(ids: list, tokens: list[list[int]] | None = None, E: int = 4) -> RoutingRecord:
    """ids: per sequence [L][R][K] nested lists; tokens default to 0..R-1."""
    ids_t = [torch.tensor(i) for i in ids]
    toks = [torch.tensor(t) for t in tokens] if tokens else [torch.arange(i.shape[1]) for i in ids_t]
    return RoutingRecord(toks, ids_t, list(range(1, 1 + ids_t[0].shape[0])), ids_t[0].shape[2], E, 256, "hand")


# layer 0 and layer 1 of one sequence of 4 tokens, K = 2
A = [[[0, 1], [2, 3], [0, 2], [1, 3]],
     [[0, 1], [2, 3], [0, 1], [1, 2]]]


def test_identical_records_and_reordered_choices_have_zero_mismatch() -> None:
    r = routing_mismatch(rec([A]), rec([A]))
    assert r["choice_mismatch"] == 0 and r["tokens_with_any_mismatch"] == 0
    assert [x["token_mismatch"] for x in r["layers"]] == [0, 0]
    swapped = [[[b, a] for a, b in layer] for layer in A]  # same sets, other order: no mismatch
    r = routing_mismatch(rec([A]), rec([swapped]))
    assert r["choice_mismatch"] == 0 and r["tokens_with_any_mismatch"] == 0


def test_known_answers() -> None:
    B = [[[0, 1], [2, 3], [0, 2], [3, 0]],   # layer 0: token 3 differs in one choice ({1,3} vs {3,0})
         [[0, 2], [2, 3], [2, 3], [1, 2]]]   # layer 1: token 0 one choice, token 2 both choices
    r = routing_mismatch(rec([A]), rec([B]))
    l0, l1 = r["layers"]
    assert (l0["block"], l1["block"]) == (1, 2)
    assert l0["choice_mismatch"] == pytest.approx(1 / 8) and l0["token_mismatch"] == pytest.approx(1 / 4)
    assert l1["choice_mismatch"] == pytest.approx(3 / 8) and l1["token_mismatch"] == pytest.approx(2 / 4)
    assert r["choice_mismatch"] == pytest.approx((1 / 8 + 3 / 8) / 2)
    assert r["tokens_with_any_mismatch"] == pytest.approx(3 / 4)  # tokens 0, 2, 3: the union over layers
    assert r["tokens_compared"] == 4
    # symmetric
    assert routing_mismatch(rec([B]), rec([A]))["layers"] == r["layers"]


def test_one_layer_different_gives_the_token_share_of_that_layer() -> None:
    # 2 sequences (3 and 5 tokens), 3 layers, K = 1; only the middle layer differs, at 2 of 8 tokens
    a = [[[[0]] * 3] * 3, [[[1]] * 5] * 3]
    b = [[[[0]] * 3, [[0], [2], [0]], [[0]] * 3], [[[1]] * 5, [[1]] * 4 + [[3]], [[1]] * 5]]
    r = routing_mismatch(rec(a, [[5, 6, 7], [1, 2, 3, 4, 5]]), rec(b, [[5, 6, 7], [1, 2, 3, 4, 5]]))
    assert [x["token_mismatch"] for x in r["layers"]] == [0, pytest.approx(2 / 8), 0]
    assert [x["choice_mismatch"] for x in r["layers"]] == [0, pytest.approx(2 / 8), 0]
    assert r["tokens_with_any_mismatch"] == pytest.approx(2 / 8)
    assert r["choice_mismatch"] == pytest.approx(2 / 8 / 3)


def test_duplicate_ids_count_as_a_multiset() -> None:
    # {0, 0} vs {0, 1}: one of the two choices differs
    r = routing_mismatch(rec([[[[0, 0]]]]), rec([[[[0, 1]]]]))
    assert r["choice_mismatch"] == pytest.approx(1 / 2) and r["tokens_with_any_mismatch"] == 1


def test_routed_prefix_in_common_is_compared() -> None:
    # A routed 4 tokens, B 3 (a sampler's record): the 4th token of A is not compared
    a = rec([[[[0], [1], [2], [3]]]])
    b = rec([[[[0], [1], [2]]]], tokens=[[0, 1, 2, 3]])
    r = routing_mismatch(a, b)
    assert r["tokens_compared"] == 3 and r["choice_mismatch"] == 0


def test_different_tokens_or_models_are_refused() -> None:
    with pytest.raises(ValueError, match="sequence 0 differs first at position 2"):
        routing_mismatch(rec([A], [[0, 1, 2, 3]]), rec([A], [[0, 1, 9, 3]]))
    with pytest.raises(ValueError, match="2 sequences in A, 1 in B"):
        routing_mismatch(rec([A, A]), rec([A]))
    with pytest.raises(ValueError, match="num_experts=4 in A, 8 in B"):
        routing_mismatch(rec([A]), rec([A], E=8))
    with pytest.raises(ValueError, match="identity_experts=0 in A, 2 in B"):  # ids 2, 3: other experts
        routing_mismatch(rec([A]), replace(rec([A]), identity_experts=2))


def test_cli_prints_a_table_writes_json_and_refuses_without_writing(tmp_path, capsys) -> None:
    B = [[[0, 1], [2, 3], [0, 2], [1, 3]], [[0, 1], [2, 3], [0, 3], [1, 2]]]
    rec([A]).save(tmp_path / "a.rec")
    rec([B]).save(tmp_path / "b.rec")
    assert main([str(tmp_path / "a.rec"), str(tmp_path / "b.rec"), "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "12.50%" in out and "25.00%" in out  # layer 2: 1 of 8 choices, 1 of 4 tokens
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["tokens_with_any_mismatch"] == pytest.approx(0.25)
    rec([A], [[9, 9, 9, 9]]).save(tmp_path / "c.rec")
    assert main([str(tmp_path / "a.rec"), str(tmp_path / "c.rec"), "--json", str(tmp_path / "n.json")]) == 2
    assert "different tokens" in capsys.readouterr().err
    assert not (tmp_path / "n.json").exists()
    assert main([str(tmp_path / "a.rec"), str(tmp_path / "b.rec"), "--json", str(tmp_path / "no" / "m.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
