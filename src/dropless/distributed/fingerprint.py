"""Collective fingerprints: what each rank issued, and where two ranks' sequences part.

Every rank of a job must issue the same collectives in the same order; a rank that skips one (a
rank-dependent branch) or issues it with other sizes leaves its peers waiting, which on a real job is
a hang after hundreds of steps with no hint where. `CollectiveLog` keeps, per rank, a running digest of
what it issued and the last `keep` entries; `divergence(reports)` compares the ranks' reports (the
log's `report()`, gathered outside any process group: distributed/watch.py) and says, in one message
that every rank computes identically, the first collective where they differ and where each rank is.

What goes into the digest is what every rank must agree on: the operation, the group's layout (its
role, "ep" / "dp" / ..., and its size), the dtype and the shape, except that a variable-split
all-to-all hashes only its trailing dimensions and number of splits (its row counts differ per rank
by design). Not the group's members: when the world holds several groups of one role (world >
ep_size: EP groups [0, 1] and [2, 3], or one EP group of one rank per rank at ep_size 1), each rank
issues on its own group, and their members differ by design. The members are kept in the entry for
the diagnosis (which collective, on whom), as are the splits, so a diagnosis can check them across
ranks: what rank a sends to rank b must be what b expects from a.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class Entry:
    """One collective as this rank issued it. `seq` counts every watched collective of the rank."""

    seq: int
    step: int
    op: str  # "all_to_all", "all_reduce"
    group: str  # role name ("ep", "dp", "world", ...)
    ranks: tuple[int, ...]  # global ranks of the group, in group-rank order (hashed: their number)
    dtype: str
    shape: tuple[int, ...]  # hashed (a variable all-to-all: its trailing dims only)
    out_splits: tuple[int, ...] | None = None  # rows received from each group rank (logged, not hashed)
    in_splits: tuple[int, ...] | None = None  # rows sent to each group rank
    digest: str = ""  # the rank's running digest after this entry

    def key(self) -> str:
        """What the digest hashes (module note): the group's role and size, not its members."""
        return f"{self.op}|{self.group}|{len(self.ranks)}|{self.dtype}|{self.shape}"

    def describe(self) -> str:
        text = f"#{self.seq} " if self.seq >= 0 else ""  # -1: not recorded (fingerprints off)
        text += f"{self.op}(group={self.group} ranks={list(self.ranks)}, {self.dtype}{list(self.shape)}"
        if self.in_splits is not None:
            text += f", send rows {list(self.in_splits)}, receive rows {list(self.out_splits or ())}"
        return text + f") in step {self.step}"

    @staticmethod
    def from_dict(d: dict) -> "Entry":
        return Entry(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


class CollectiveLog:
    """A rank's running digest of the collectives it issued, and the last `keep` of them."""

    def __init__(self, keep: int = 256) -> None:
        self.count = 0
        self.digest = hashlib.blake2b(b"", digest_size=8).hexdigest()
        self.recent: deque[Entry] = deque(maxlen=keep)

    def record(self, op: str, group: str, ranks: Sequence[int], dtype: str, shape: Sequence[int], step: int,
               out_splits: Sequence[int] | None = None, in_splits: Sequence[int] | None = None) -> Entry:
        e = Entry(self.count, step, op, group, tuple(ranks), dtype, tuple(shape),
                  None if out_splits is None else tuple(out_splits),
                  None if in_splits is None else tuple(in_splits))
        self.digest = hashlib.blake2b(f"{self.digest}|{e.key()}".encode(), digest_size=8).hexdigest()
        e = Entry(**{**asdict(e), "digest": self.digest})
        self.recent.append(e)
        self.count += 1
        return e

    def report(self, rank: int, step: int, where: str, in_flight: Entry | None) -> dict:
        """What a rank tells the others: JSON-able. `where`: what the rank is doing ("the check of step
        12", "waiting in a collective")."""
        return {"rank": rank, "step": step, "count": self.count, "digest": self.digest, "where": where,
                "in_flight": None if in_flight is None else asdict(in_flight),
                "recent": [asdict(e) for e in self.recent]}


def _entries(report: dict) -> dict[int, Entry]:
    return {d["seq"]: Entry.from_dict(d) for d in report.get("recent", [])}


def _split_mismatch(at: dict[int, Entry]) -> str | None:
    """For one variable all-to-all seen on several ranks of the same group: a rank sending a number of
    rows its peer does not expect."""
    for a, ea in at.items():
        for b, eb in at.items():
            if (a == b or ea.in_splits is None or eb.out_splits is None or ea.ranks != eb.ranks
                    or a not in ea.ranks or b not in ea.ranks):
                continue
            sent, expected = ea.in_splits[ea.ranks.index(b)], eb.out_splits[eb.ranks.index(a)]
            if sent != expected:
                return f"rank {a} sends {sent} rows to rank {b}, which expects {expected}"
    return None


def _where(report: dict) -> str:
    flight = report.get("in_flight")
    if flight is not None:
        return f"rank {report['rank']} waits in {Entry.from_dict(flight).describe()}"
    return f"rank {report['rank']} is at {report['where']} after {report['count']} collectives"


def divergence(reports: dict[int, dict], world: Sequence[int], timeout_s: float | None = None) -> str | None:
    """None when every rank of `world` reported the same sequence of collectives and nothing waits;
    else the diagnosis: ranks that did not report, the first collective where the ranks differ (or
    the one a rank waits in that others never issued), and where every rank is."""
    missing = [r for r in world if r not in reports]
    lines: list[str] = []
    if missing:
        wait = f" within {timeout_s:g} s" if timeout_s is not None else ""
        lines.append(f"ranks {missing} did not arrive{wait} (stuck outside a watched collective, or dead)")
    entries = {r: _entries(rep) for r, rep in reports.items()}
    flights = {r: Entry.from_dict(rep["in_flight"]) for r, rep in reports.items() if rep.get("in_flight")}
    for r, e in flights.items():  # a collective in flight is part of what the rank issued
        if e.seq >= 0:  # (seq -1: fingerprints off, the entry only says where the rank waits)
            entries[r][e.seq] = e
    counts = {r: max(ent, default=-1) + 1 for r, ent in entries.items()}
    same = len({(rep["count"], rep["digest"]) for rep in reports.values()}) <= 1
    if reports and not (same and not flights and not missing):
        first = None
        lo = max((min(ent, default=0) for ent in entries.values()), default=0)
        for seq in range(lo, max(counts.values(), default=0)):
            at = {r: ent.get(seq) for r, ent in entries.items()}
            keys = {None if e is None else e.key() for e in at.values()}
            if len(keys) > 1:
                first = seq
                issued = {r: e for r, e in at.items() if e is not None}
                never = sorted(r for r, e in at.items() if e is None)
                lines.append(f"first divergence at collective #{seq}: "
                             + "; ".join(f"rank {r} issued {e.describe()}" for r, e in sorted(issued.items()))
                             + (f"; ranks {never} never issued it" if never else ""))
                break
            bad = _split_mismatch({r: e for r, e in at.items() if e is not None})
            if bad is not None:
                first = seq
                lines.append(f"first divergence at collective #{seq} ({next(iter(at.values())).describe()}): {bad}")
                break
        if first is None and not same:
            lines.append(f"the fingerprints differ before the last {len(next(iter(entries.values())))} "
                         "collectives each rank keeps: "
                         + "; ".join(f"rank {r}: {rep['count']} collectives, digest {rep['digest']}"
                                     for r, rep in sorted(reports.items())))
        if first is None and same and flights and not missing:
            recorded = any(rep["count"] for rep in reports.values())
            lines.append("every rank issued the same collectives; the transport timed out (a slow or broken "
                         "link, or a peer stuck in a collective this log does not watch, e.g. FSDP's)"
                         if recorded else "no fingerprints to compare (parallel.check_collectives = false)")
    if not lines:
        return None
    lines += [_where(rep) for _, rep in sorted(reports.items())]
    return "collectives diverged: " + "\n  ".join(lines)
