"""ExpertSlots (expert_slots.py): the counts for plain, identity and replicated layers, and the consumers
asking the built layer agree with it (router rows, expert weights, dispatcher groups, statistics,
the monitor's tables, routing records, serving's top-k, the packed experts, the replica tables,
the planner).

Shapes: E=4 routed experts, Z=2 identity experts (the default tiny run with the identity knob), and
for the replica mapping E=8 over P=2 ranks with S=1 spare slot (L=4: an owner slot of rank 1 sits
after rank 0's spare slot, so a table that forgot the spare slots would be off by one there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dropless.distributed import ep_replicas as rep
from dropless.expert_slots import ExpertSlots
from dropless.model import MoEModel
from dropless.plan.ep_buffers import ep_rows
from dropless.runs import packed
from dropless.data.routing_record import RoutingRecord
from dropless.serve.serving import serving_top_k
from dropless.train.health import TrainHealth
from tiny_run import tiny

E, Z = 4, 2


def test_counts_plain_identity_and_replicas() -> None:
    plain = ExpertSlots(E)
    assert (plain.routed, plain.identity, plain.selectable, plain.local, plain.physical) == (4, 0, 4, 4, 4)
    ident = ExpertSlots(E, Z)
    assert (ident.routed, ident.selectable, ident.local_slots) == (4, 6, 4)
    assert ident.is_identity(torch.arange(6)).tolist() == [False] * 4 + [True] * 2
    s = ExpertSlots(8, ep_size=2, spare=1)
    assert (s.local, s.local_slots, s.physical, s.selectable) == (4, 5, 10, 8)
    assert s.owner_slot(torch.arange(8)).tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert [s.spare_slot(r, 0) for r in (0, 1)] == [4, 9]
    assert [s.owner(e) for e in (3, 4)] == [0, 1] and s.first_local(1) == 4
    # identity experts are never sharded or replicated: the same selectable range on every rank
    assert ExpertSlots(E, Z).sharded(2).with_spare(1) == ExpertSlots(E, Z, ep_size=2, spare=1)
    assert ExpertSlots(E, Z, ep_size=2, spare=1).selectable == 6


@pytest.mark.parametrize("kw,message", [
    (dict(routed=6, ep_size=4), "num_experts=6 is not divisible by ep_size=4"),
    (dict(routed=4, spare=1), "ExpertSlots.spare=1"),  # a copy never sits on its owner: needs EP
    (dict(routed=0), "ExpertSlots.routed=0"),
    (dict(routed=4, identity=-1), "ExpertSlots.identity=-1"),
])
def test_bad_slots_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExpertSlots(**kw)


def test_the_built_layer_owns_its_slots_and_its_parts_agree() -> None:
    model = MoEModel(tiny(f"model.moe.n_identity_experts={Z}").model)
    slots = model.expert_slots()
    assert slots == ExpertSlots(E, Z) == ExpertSlots.from_config(model.cfg.moe)
    for layer in model.moe_layers():
        assert layer.slots == slots
        assert layer.router.weight.shape[0] == layer.router.num_experts == slots.selectable
        assert layer.experts.w_gate_up_EDF.shape[0] == layer.dispatcher.num_experts == slots.routed
        assert packed.expert_shape(layer)[0] == slots.routed
        layer.detailed_stats = True
    out = model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    for m in out.moe:
        assert m.stats.tokens_per_expert_E.shape == m.stats.out_sq_E.shape == (slots.selectable,)
    # a model without MoE layers routes nothing: the config's slots
    assert MoEModel(tiny("model.n_dense_layers=2").model).expert_slots() == ExpertSlots(E)


def test_consumers_size_by_the_slots(tmp_path: Path) -> None:
    model = MoEModel(tiny(f"model.moe.n_identity_experts={Z}").model)
    slots = model.expert_slots()
    # the monitor's per-expert tables: every selectable expert
    health = TrainHealth(model, tmp_path, torch.zeros(1, 4, dtype=torch.long), write=False)
    assert health.acc.E == health.acc.counts_LE.shape[1] == slots.selectable
    # a routing record's id range and its identity experts
    rec = RoutingRecord.for_model(model, [torch.arange(3)], [torch.full((1, 3, 2), slots.selectable - 1)], "x")
    assert (rec.num_experts, rec.identity_experts) == (slots.selectable, slots.identity)
    # serving may run up to every selectable expert per token, as the router can choose them
    assert serving_top_k(model.cfg, 6).moe.top_k == 6
    with pytest.raises(ValueError, match=r"--serve-top-k=7 \(k1\): exceeds model.moe.num_experts=4 \+ "
                                         r"n_identity_experts=2"):
        serving_top_k(model.cfg, 7)
    # the planner's local experts under EP
    cfg = tiny(f"model.moe.n_identity_experts={Z}", "parallel.ep_size=2")
    assert ep_rows(cfg, 64, 2)[0] == ExpertSlots.from_config(cfg.model.moe).sharded(2).local == 2


def test_replica_tables_follow_the_physical_slots() -> None:
    s = ExpertSlots(8, ep_size=2, spare=1)
    owner, copy, frac = rep.slot_tables((rep.Replica(1, 1, 0, 0.5), rep.Replica(6, 0, 0, 1.0)), s,
                                        torch.device("cpu"))
    assert owner.tolist() == s.owner_slot(torch.arange(8)).tolist()
    assert copy.tolist() == [0, 9, 2, 3, 5, 6, 4, 8] and frac.tolist() == [0, 0.5, 0, 0, 0, 0, 1.0, 0]
    ids_TK = torch.arange(8).repeat(4, 1)
    v = rep.virtual_ids(ids_TK, (owner, copy, frac))
    assert int(v.min()) >= 0 and int(v.max()) < s.physical
    assert (v[:, 6] == 4).all()  # fraction 1: every pair of expert 6 goes to rank 0's spare slot
