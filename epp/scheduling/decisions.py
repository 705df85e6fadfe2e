"""The scheduler's last decisions, kept for the EPP's status page (`epp/status.py`): a ring of a fixed size, filled
at most `per_second` decisions a second.

The rate bound is what makes the ring cheap where the EPP is busy: past it, a decision costs a clock reading and
two counters. A person reads a few decisions a second; at the bench's 2,000 a second an unbounded ring of 1,000 held
the last half second and cost the live EPP 1.09x its CPU per request against no ring (`epp-bench overhead` at
concurrency 32, the release build; docs/2026-11-29-redesign.md). Bounded at 100 a second, the default
ring holds at least the last ten seconds, at any rate; below the bound it holds every decision. Past it, the first
`per_second` of each wall-clock second are kept and the rest only counted (`made`).

Recording one costs the request path one plain tuple of what the cycle built (the result's endpoints, candidates, raw
scores, totals and timings; never its cycle state, which can hold a long prompt's tokens) and an append to a bounded
deque; the page's `Decision` is made from it when the page asks (`since`, `get`), as is what it shows beyond that
(`explain`: the runner-up, why the pick won). Tuples, not the result's own lists: a tuple of numbers, names and
tuples of them stops being tracked by the garbage collector at its first collection, so the ring adds three tracked
objects per decision to the old generation (the entry and its two tuples of endpoints), not the ~15 lists and dicts
of the result. The plugins' names are kept once per profile, not per decision, and the entry is a plain tuple: a
NamedTuple's `__new__` runs as Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from time import time
from typing import NamedTuple

import cython

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest, SchedulingResult, TypedName, clamp_score

# What the status page keeps by default: 1,000 decisions of 64 candidates hold ~2 MB of score lists (kept alive
# here, built by the cycle anyway) and render in well under a second (docs/observability.md).
DEFAULT_DECISIONS = 1000
# Decisions kept a second at most: the default ring then spans ten seconds or more.
DEFAULT_DECISIONS_PER_SECOND = 100


class Decision(NamedTuple):
    """One scheduling cycle as the status page reads it."""

    seq: int  # 1, 2, ...: a page polls for the decisions after the last one it has
    at: float  # wall-clock time (time.time())
    request_id: str
    model: str  # the model the server sees (after any rewrite)
    priority: int
    fairness_id: str | None
    prompt_tokens: int  # the estimate the scheduler used
    considered: int  # endpoints the filters started from (the pool, or the subset hint's share of it)
    endpoints: tuple[Endpoint, ...]  # the pick, then the fallbacks
    candidates: tuple[Endpoint, ...]  # after the filters, in the scores' order
    # plugins as plain (type, name) tuples (equal to their TypedName): a NamedTuple is never untracked
    raw_scores: tuple[tuple[tuple[str, str], tuple[float, ...]], ...]  # (scorer, its scores), in the profile's order
    totals: tuple[float, ...]  # per candidate, the scorers' weighted sum
    timings: tuple[tuple[tuple[str, str], float], ...]


class DecisionLog:
    """The last `size` decisions kept, oldest first: every decision while fewer than `per_second` are made in a
    wall-clock second, the first `per_second` of each second past that (0: every decision). `clock` gives the
    decisions' wall-clock time."""

    def __init__(
        self,
        size: int = DEFAULT_DECISIONS,
        per_second: int = DEFAULT_DECISIONS_PER_SECOND,
        clock: Callable[[], float] = time,
    ):
        if size < 1:
            raise ValueError(f"a decision log holds at least one decision, not {size}")
        if per_second < 0:
            raise ValueError(f"decisions kept a second cannot be negative: {per_second}")
        self.per_second = per_second
        self._clock = clock
        self.made = 0  # decisions made since start, kept or not
        self._second = -1  # the wall-clock second of the last decision made
        self._in_second = 0  # decisions kept in that second
        # Decision's fields as a plain tuple, but the raw scores and the timings each split into the plugins' names
        # (a tuple shared by every decision of the same plugins) and their values
        self._entries: deque[tuple] = deque(maxlen=size)
        self.count = 0  # decisions kept since start (the last one's seq)
        # the plugins of a cycle (TypedName, a NamedTuple: never untracked) -> the same as plain (type, name) tuples
        self._plain: dict[tuple[TypedName, ...], tuple[tuple[str, str], ...]] = {}

    @property
    def size(self) -> int:
        return self._entries.maxlen or 0

    @property
    def entries(self) -> list[Decision]:
        """Every decision kept, oldest first."""
        return [_decision(entry) for entry in self._entries]

    @property
    def first(self) -> int:
        """The oldest kept decision's seq (0 when none is kept)."""
        entries = self._entries
        return entries[0][0] if entries else 0

    def record(self, request: SchedulingRequest, result: SchedulingResult, considered: int) -> None:
        self.made += 1
        now = self._clock()
        if self.per_second:
            second = int(now)
            if second != self._second:
                self._second, self._in_second = second, 0
            if self._in_second >= self.per_second:
                return
            self._in_second += 1
        self.count = seq = self.count + 1
        raw_scores, timings = result.raw_scores, result.timings
        timed = tuple([name for name, _ in timings])
        self._entries.append(
            (
                seq,
                now,
                request.request_id,
                request.model,
                request.priority,
                request.fairness_id,
                request.prompt_tokens_estimate,
                considered,
                tuple(result.endpoints),
                tuple(result.candidates),
                _plain_names(self._plain, tuple(raw_scores)),
                tuple([tuple(scores) for scores in raw_scores.values()]),
                tuple(result.totals),
                _plain_names(self._plain, timed),
                tuple([seconds for _, seconds in timings]),
            )
        )

    def since(self, seq: int) -> Iterator[Decision]:
        """The decisions after `seq` still kept, oldest first."""
        entries = self._entries
        if not entries:
            return iter(())
        skip = max(0, seq - entries[0][0] + 1)
        return (_decision(entries[i]) for i in range(min(skip, len(entries)), len(entries)))

    def get(self, seq: int) -> Decision | None:
        entries = self._entries
        index = seq - entries[0][0] if entries else -1
        return _decision(entries[index]) if 0 <= index < len(entries) else None


@cython.cfunc
def _plain_names(
    known: dict[tuple[TypedName, ...], tuple[tuple[str, str], ...]], names: tuple[TypedName, ...]
) -> tuple[tuple[str, str], ...]:
    """`names` as plain (type, name) tuples, made once for each cycle's plugins (a C function in the release build:
    as a method, each call went through Python's method call)."""
    plain = known.get(names)
    if plain is None:
        plain = known[names] = tuple([(name.type, name.name) for name in names])
    return plain


def _decision(entry: tuple) -> Decision:
    """A ring entry as the page reads it (`DecisionLog.record` wrote it)."""
    *fields, scorers, scores, totals, timed, seconds = entry
    return Decision(*fields, tuple(zip(scorers, scores, strict=True)), totals, tuple(zip(timed, seconds, strict=True)))


class Explained(NamedTuple):
    """Where the pick and the runner-up are among a decision's candidates, and why the pick won, in words."""

    picked: int  # the pick's index among the candidates (-1: not among them)
    runner_up: int  # the best-scored other candidate's index (-1: none)
    reason: str


def ranked(decision: Decision) -> list[int]:
    """The candidates' indexes, best total first, the pick first when it was not the best."""
    totals, pick = decision.totals, decision.endpoints[0]
    return sorted(range(len(totals)), key=lambda i: (decision.candidates[i] is not pick, -totals[i]))


def explain(decision: Decision, weights: Mapping[TypedName, float]) -> Explained:
    """Why the pick won: the only candidate, the best total (with the margin over the runner-up and the scorer whose
    weighted score gave most of it), a tie the picker broke, or the picker's own choice below the best total."""
    candidates, totals = decision.candidates, decision.totals
    pick = decision.endpoints[0]
    picked = next((i for i, e in enumerate(candidates) if e is pick), -1)
    runner = max((i for i in range(len(totals)) if i != picked), key=totals.__getitem__, default=-1)
    if picked < 0:
        return Explained(picked, runner, "the pick is not among the scored candidates")
    if runner < 0:
        filtered = decision.considered - len(candidates)
        removed = f"; the filters removed {filtered}" if filtered else ""
        return Explained(picked, runner, f"the only candidate (of {decision.considered}{removed})")
    if not decision.raw_scores:
        return Explained(picked, runner, f"no scorer expressed a preference: the picker chose among {len(candidates)}")
    mine, second = totals[picked], totals[runner]
    if mine < second - 1e-9:
        return Explained(picked, runner, f"the picker chose it below the best total ({mine:.3f} < {max(totals):.3f})")
    if mine <= second + 1e-9:
        ties = sum(1 for t in totals if t >= mine - 1e-9) - 1
        return Explained(picked, runner, f"tied at {mine:.3f} with {ties} other(s): the picker broke the tie")
    margins = [
        (weights.get(name, 1.0) * (clamp_score(s[picked]) - clamp_score(s[runner])), name)
        for name, s in decision.raw_scores
    ]
    margin, scorer = max(margins, key=lambda m: m[0])
    return Explained(
        picked,
        runner,
        f"best total {mine:.3f}, {mine - second:.3f} ahead of {candidates[runner].name}; "
        f"most from {scorer[1]} (+{margin:.3f})",
    )
