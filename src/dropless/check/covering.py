"""A pairwise covering array over the factors (factors.py), with the config's validation as the
constraint: every pair of values of two factors meets in at least one row that validation accepts.

Pairs. A pair of values is *refused* when its config (the two values set, every other factor at its
default) is refused by validation; the refusal must be a ValueError naming a field of each value
(`refusal_names_both`). Every other pair is *allowed* and must be covered by an accepted row: a row
refused as a whole (three or more values that refuse together) covers nothing and is never emitted.

Generator: greedy, AETG-style, deterministic for a seed. Each new row starts from the uncovered pair of
the value left in the most uncovered pairs (with its most-needed partner); of `CANDIDATES` candidates
(each takes the other factors in a seeded random order and gives each the value that covers the most
uncovered pairs with the values already chosen; ties: the lower index, so the default) the one
covering most is kept. A value never joins one it forms a refused pair with, nor an expensive pair
that is covered already (factors.EXPENSIVE). A candidate that validation refuses is repaired by
setting its later factors back to their defaults, one at a time, until it validates; the starting
pair alone with defaults validates by definition, so every row covers at least that pair and the
loop ends. Then `_compact` drops the rows whose few own pairs fit into other rows. `coverage`
re-checks the result from scratch: tests/check/test_matrix.py is the proof.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..config import RunConfig, apply_overrides, load_config
from . import factors as fx

CANDIDATES = 24
MOVE_LIMIT = 40  # compaction tries to drop the rows that alone cover at most this many pairs
SEED = 1
Slot = tuple[int, int]  # (factor index, value index)
Pair = tuple[Slot, Slot]  # the lower factor index first


@cache
def base_config() -> RunConfig:
    from ..runs.presets import preset_path

    return load_config(preset_path(fx.PRESET), fx.BASE)


def field_value(dotted: str) -> Any:
    obj: Any = base_config()
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def overrides(values: list[fx.Value]) -> list[str]:
    """The row's `--set` overrides after BASE (templates filled in)."""
    return fx.config_overrides(values, field_value)


def refusal(values: list[fx.Value]) -> str | None:
    """None when validation accepts BASE + these values, else the ValueError's message."""
    try:
        apply_overrides(base_config(), overrides(values))
    except ValueError as err:
        return str(err)
    return None


def names_field(message: str, field: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(field)}(?![\w])", message) is not None


def refusal_names_both(message: str, a: fx.Value, b: fx.Value) -> bool:
    return any(names_field(message, f) for f in a.fields) and any(names_field(message, f) for f in b.fields)


@dataclass
class Matrix:
    factors: list[list[fx.Value]]
    rows: list[tuple[int, ...]]  # a value index per factor
    refused: dict[Pair, str]  # refused pair -> validation's message
    allowed: list[Pair]

    def values(self, row: tuple[int, ...]) -> list[fx.Value]:
        return [self.factors[f][v] for f, v in enumerate(row)]

    def pair_values(self, pair: Pair) -> tuple[fx.Value, fx.Value]:
        (f, v), (g, w) = pair
        return self.factors[f][v], self.factors[g][w]


def all_pairs(fs: list[list[fx.Value]]) -> list[Pair]:
    return [((f, v), (g, w)) for f, g in itertools.combinations(range(len(fs)), 2)
            for v in range(len(fs[f])) for w in range(len(fs[g]))]


def classify(fs: list[list[fx.Value]]) -> tuple[list[Pair], dict[Pair, str]]:
    """(allowed pairs, refused pair -> message), each pair validated alone with defaults around it."""
    allowed, refused = [], {}
    for pair in all_pairs(fs):
        (f, v), (g, w) = pair
        msg = refusal([fs[f][v], fs[g][w]]) if v or w else None
        if msg is None:
            allowed.append(pair)
        else:
            refused[pair] = msg
    return allowed, refused


def _expensive(fs: list[list[fx.Value]]) -> set[Pair]:
    index = {(f, fs[f][v].factor, fs[f][v].label): (f, v) for f in range(len(fs)) for v in range(len(fs[f]))}
    by_name = {(name, label): slot for (_, name, label), slot in index.items()}
    return {tuple(sorted((by_name[a], by_name[b]))) for a, b in fx.EXPENSIVE}


def generate(seed: int = SEED) -> Matrix:
    fs = fx.factors()
    allowed, refused = classify(fs)
    uncovered = set(allowed)
    expensive = _expensive(fs)
    rng = random.Random(seed)
    rows: list[tuple[int, ...]] = []
    while uncovered:
        best, best_gain = None, -1
        start = _start(uncovered)
        for _ in range(CANDIDATES):
            row = _candidate(fs, start, uncovered, refused, expensive, rng)
            gain = len(pairs_of(row) & uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        rows.append(best)
        uncovered -= pairs_of(best)
    return Matrix(fs, _compact(fs, rows, set(allowed), expensive), refused, allowed)


def _start(uncovered: set[Pair]) -> Pair:
    """The uncovered pair of the slot left in the most uncovered pairs, with its most-needed partner."""
    count: dict[Slot, int] = {}
    for a, b in uncovered:
        count[a] = count.get(a, 0) + 1
        count[b] = count.get(b, 0) + 1
    slot = min(count, key=lambda s: (-count[s], s))
    return min((p for p in uncovered if slot in p),
               key=lambda p: (-count[p[0] if p[1] == slot else p[1]], p))


def _forbidden(p: Pair, refused: dict[Pair, str], expensive: set[Pair], uncovered: set[Pair]) -> bool:
    return p in refused or (p in expensive and p not in uncovered)


def _candidate(fs: list[list[fx.Value]], pair: Pair, uncovered: set[Pair], refused: dict[Pair, str],
               expensive: set[Pair], rng: random.Random) -> tuple[int, ...]:
    """A row from `pair`: each other factor, in a seeded random order, takes the value covering the most
    uncovered pairs with the values chosen so far (ties: the lower index, so the default)."""
    (f0, v0), (g0, w0) = pair
    chosen = {f0: v0, g0: w0}
    order = [f for f in range(len(fs)) if f not in chosen]
    rng.shuffle(order)
    for f in order:
        best_v, best_gain = 0, -1
        for v in range(len(fs[f])):
            pairs = [_pair((g, w), (f, v)) for g, w in chosen.items()]
            if any(_forbidden(p, refused, expensive, uncovered) for p in pairs):
                continue
            gain = sum(p in uncovered for p in pairs)
            if gain > best_gain:
                best_v, best_gain = v, gain
        chosen[f] = best_v
    row = [chosen[f] for f in range(len(fs))]
    for f in reversed(order):  # repair: later choices back to their defaults until it validates
        if refusal([fs[g][v] for g, v in enumerate(row)]) is None:
            break
        row[f] = 0
    return tuple(row)


def _compact(fs: list[list[fx.Value]], rows: list[tuple[int, ...]], allowed: set[Pair],
             expensive: set[Pair]) -> list[tuple[int, ...]]:
    """Drop rows whose pairs fit elsewhere: for each row (the last first), move each pair only it
    covers into another row by changing that row's cells for the pair, where every pair the change
    uncovers is covered by a third row and the changed row still validates; drop the row only when
    all its pairs moved."""
    rows = [list(r) for r in rows]
    r = len(rows) - 1
    while r >= 0 and len(rows) > 1:
        rest = [list(x) for i, x in enumerate(rows) if i != r]
        count: dict[Pair, int] = {}
        for x in rest:
            for p in pairs_of(tuple(x)) & allowed:
                count[p] = count.get(p, 0) + 1
        missing = sorted(p for p in pairs_of(tuple(rows[r])) & allowed if not count.get(p))
        if len(missing) <= MOVE_LIMIT and all(_place(fs, rest, p, count, allowed, expensive) for p in missing):
            rows = rest
        r = min(r, len(rows)) - 1
    return [tuple(x) for x in rows]


def _place(fs: list[list[fx.Value]], rows: list[list[int]], pair: Pair, count: dict[Pair, int],
           allowed: set[Pair], expensive: set[Pair]) -> bool:
    if count.get(pair):
        return True
    (f, v), (g, w) = pair
    for row in rows:
        new = list(row)
        new[f], new[g] = v, w
        old_pairs, new_pairs = pairs_of(tuple(row)) & allowed, pairs_of(tuple(new)) & allowed
        lost = old_pairs - new_pairs
        if any(count[q] == 1 for q in lost):
            continue
        if any(q in expensive and count.get(q) for q in new_pairs - old_pairs):
            continue
        if refusal([fs[h][x] for h, x in enumerate(new)]) is not None:
            continue
        for q in lost:
            count[q] -= 1
        for q in new_pairs - old_pairs:
            count[q] = count.get(q, 0) + 1
        row[:] = new
        return True
    return False


def pairs_of(row: tuple[int, ...]) -> set[Pair]:
    return {((f, row[f]), (g, row[g])) for f, g in itertools.combinations(range(len(row)), 2)}


def _pair(a: Slot, b: Slot) -> Pair:
    return (a, b) if a[0] < b[0] else (b, a)


def coverage(m: Matrix) -> tuple[set[Pair], list[int]]:
    """(allowed pairs no accepted row covers, indices of rows validation refuses), from scratch."""
    accepted = [i for i, row in enumerate(m.rows) if refusal(m.values(row)) is None]
    covered = set().union(*(pairs_of(m.rows[i]) for i in accepted)) if accepted else set()
    refused_rows = [i for i in range(len(m.rows)) if i not in accepted]
    return set(m.allowed) - covered, refused_rows
