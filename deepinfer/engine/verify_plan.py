"""Throughput-aware verification: whether a step speculates, and how many of its drafts each sequence
verifies.

A draft is worth its row only if it is likely to hold and the row costs little: verifying j drafts of a
sequence yields, in expectation, 1 + a_1 + ... + a_j tokens, where a_j (its survival) is the chance that
drafts 1..j all hold, and the step takes longer the more rows it has. Speculating also costs a step of
its own kind: one that verifies drafts has more rows and may run a drafter after it (and with a
structured request is read back before the next step is scheduled), while a plain step has neither.
`plan_verify` picks the lengths by greedy global admission over every sequence's drafts (most likely
first, which keeps each sequence's admitted drafts a prefix of its own), stopping at the count that
maximises expected tokens per second,
against a plain step's tokens per second: admitting none means the step runs plain. `StepCost` holds the
two time curves it reads (rows in a step -> seconds: recent steps' median per row bucket, linear between
buckets), `HoldRates` a sequence's survivals, learnt from its own verifications (the chance that each
draft position holds given the ones before it, from recent counts) pooled with its drafter's over every
sequence, which learns from a whole step's verifications at once. A model drafter's confidence head
says how much more or less likely than usual the block at hand is to hold: the scheduler scales each
learnt rate by the head's confidence in the draft over its mean confidence in the drafts verification
reached there (`HeadLevels`), so a head that is wrong by a constant factor plans as a calibrated one.
The drafter starts from an optimistic prior, so it is tried before it is judged, and one whose drafts
never hold stops costing anything within a step or two: its engine runs plain steps, as with
speculation off. Plain steps teach the rates nothing, so `Exploration` has such an engine probe its
drafter now and then, at a bounded share of the plain steps' time.

None of this changes outputs: a step yields the tokens the target samples, bitwise the same whatever
it verifies (see `deepinfer.engine.drafter`). It changes only how many steps those tokens take, and
since it reads measured times it may differ from run to run: so may a run's speculation counts.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter

PRIOR_HOLD = 0.75  # the chance that each draft holds, before any verification says otherwise
DRAFTER_PRIOR = 1.0  # how many verifications that prior counts as, for a drafter's rates
HOLD_MEMORY = 0.3  # how much of its evidence a rate forgets at each new round of it
POOL_WEIGHT = 2.0  # how many verifications of its own the drafter's rate counts as, for a sequence
COST_WINDOW = 32  # steps per row bucket whose median the curve keeps
PROBE_SHARE = 0.01  # of the plain steps' time since the last speculative step, what a probe may cost


@dataclass
class HoldRates:
    """Per draft position j (0-based), the chance that draft j holds given that drafts before it held,
    from counts of the verifications that reached j (`tried`) and held there (`held`), older ones
    forgotten at HOLD_MEMORY per round of evidence (so about 1 / HOLD_MEMORY rounds count once many
    have come). A drafter's record (over every sequence) starts from `prior` verifications at
    PRIOR_HOLD, forgotten like the rest, and takes a whole step's evidence as one round
    (`observe_step`): a batch learns in one step what a lone sequence learns in several. A sequence's
    own record has no prior: its rates pool its counts with its drafter's rates, weighed as POOL_WEIGHT
    verifications, so a new sequence starts from the drafter's and one with a history mostly follows
    its own."""

    held: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)
    prior: float = 0.0
    rounds: int = 0  # rounds of evidence taken: survivals computed before the last one are stale
    # the last `survivals` asked for and what they were: a plan in every plain step asks for each running
    # sequence's again, and in plain steps no record learns anything
    _last: tuple | None = field(default=None, repr=False, compare=False)

    def rate(self, j: int, pool: "HoldRates | None" = None) -> float:
        """The chance that draft j holds if the ones before it did: this record's counts, with `pool`'s
        rate counted as POOL_WEIGHT more verifications; PRIOR_HOLD where nothing is known."""
        held, tried = (self.held[j], self.tried[j]) if j < len(self.tried) else (self.prior * PRIOR_HOLD, self.prior)
        if pool is not None:
            return (held + POOL_WEIGHT * pool.rate(j)) / (tried + POOL_WEIGHT)
        return held / tried if tried > 0 else PRIOR_HOLD

    def survivals(self, count: int, pool: "HoldRates | None" = None) -> list[float]:
        """a_1 .. a_count: the chance that the first j drafts all hold (the same list while neither this
        record nor `pool` has learnt anything since: not to be changed)."""
        asked = (count, self.rounds, None if pool is None else pool.rounds)
        if self._last is not None and self._last[0] == asked and self._last[1] is pool:
            return self._last[2]
        out, survival = [], 1.0
        for j in range(count):
            survival *= self.rate(j, pool)
            out.append(survival)
        self._last = (asked, pool, out)
        return out

    def observe(self, verified: int, kept: int) -> None:
        """A step verified `verified` drafts and `kept` of them held (the first `kept`): positions before
        `kept` held, position `kept` failed if it was verified, later ones were not tried."""
        self.observe_step([(verified, kept)])

    def observe_step(self, verifications: list[tuple[int, int]]) -> None:
        """One step's (verified, kept), one per sequence that verified drafts, as one round of evidence:
        each position reached forgets once, then counts every verification that reached it. A step that
        reached no position (a plain one) is no round: nothing changes, and the survivals kept stay valid
        (a plan asks for every running sequence's again in each plain step)."""
        outcomes = [[1.0 if j < kept else 0.0 for j in range(reached(verified, kept))]
                    for verified, kept in verifications]
        if not any(outcomes):
            return
        add_round(self.held, self.tried, outcomes, (self.prior * PRIOR_HOLD, self.prior))
        self.rounds += 1


def reached(verified: int, kept: int) -> int:
    """How many draft positions a verification of `verified` drafts that kept `kept` decided: those
    that held and the first that failed."""
    return min(kept + 1, verified)


def add_round(sums: list[float], counts: list[float], blocks: list[list[float]], start: tuple[float, float]) -> None:
    """One round of evidence, per draft position j the values `blocks` have there (a block has values at
    its first positions): each position reached forgets HOLD_MEMORY of its sums and counts, then adds
    them; a position reached the first time starts from `start` (sum, count)."""
    for j in range(max(map(len, blocks), default=0)):
        if j == len(counts):
            sums.append(start[0])
            counts.append(start[1])
        values = [block[j] for block in blocks if j < len(block)]
        sums[j] = (1 - HOLD_MEMORY) * sums[j] + sum(values)
        counts[j] = (1 - HOLD_MEMORY) * counts[j] + len(values)


@dataclass
class HeadLevels:
    """Per draft position j, a model drafter's mean confidence (its head's chance that draft j holds if
    the ones before it did) over the drafts verification reached at j, forgotten as `HoldRates` forget:
    the level the head's confidences are read against. Only the head's relative doubt counts
    (`relative`): briefly distilled, or reading other text than it learnt from, a head's confidences
    can be off by a factor (one that always says 0.1 where 3 in 10 hold would otherwise never be
    verified, and so never be found wrong), and a head whose drafts have not been verified yet is not
    read at all, so the drafter is tried before it is judged."""

    sums: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    def relative(self, j: int, confidence: float) -> float:
        """`confidence` at position j over the mean there (1 where no verification reached j yet, or the
        head gave all it reached 0)."""
        if j >= len(self.counts) or self.counts[j] <= 0 or self.sums[j] <= 0:
            return 1.0
        return confidence / (self.sums[j] / self.counts[j])

    def observe_step(self, verifications: list[tuple[list[float], int, int]]) -> None:
        """One step's (confidences, verified, kept), one per chunk that verified drafts the head scored."""
        add_round(self.sums, self.counts,
                  [confidences[:reached(verified, kept)] for confidences, verified, kept in verifications], (0.0, 0.0))


def confidences(survivals: list[float]) -> list[float]:
    """A head's confidence in each draft (the chance it holds if the ones before it did) from its
    survivals (the chance that all up to it hold, their running product): 0 after a survival of 0."""
    return [a / before if before > 0 else 0.0 for a, before in zip(survivals, [1.0, *survivals])]


class TimeCurve:
    """Seconds of a step of `rows` rows, from the steps actually run: per power-of-two row bucket the
    median of its last COST_WINDOW steps, linear between the buckets measured, flat outside them. So a
    size not measured yet costs what the nearest measured one does (before any step, every size costs
    the same): optimistic, as in a GPU's small batches, where a forward's time is the reading of its
    weights; drafts are tried, and the steps they make measure what they really cost."""

    def __init__(self) -> None:
        self._steps: dict[int, deque[tuple[int, float]]] = {}
        self._points: list[tuple[float, float]] | None = []  # (rows, seconds) per bucket; None: to recompute
        self._at: dict[int, float] = {}  # seconds by rows, from the points as they are

    @staticmethod
    def _bucket(rows: int) -> int:
        return max(rows - 1, 0).bit_length()

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self._steps.setdefault(self._bucket(rows), deque(maxlen=COST_WINDOW)).append((rows, seconds))
            self._points = None

    def seconds(self, rows: int) -> float:
        """A plan asks once per draft it weighs (and one in every plain step, for each running sequence's
        drafts): the medians are taken once per step observed, and each size's time once per change."""
        if self._points is None:
            self._points = sorted((statistics.median(r for r, _ in steps), statistics.median(s for _, s in steps))
                                  for steps in self._steps.values())
            self._at = {}
        if rows not in self._at:
            self._at[rows] = self._between(rows)
        return self._at[rows]

    def _between(self, rows: int) -> float:
        points = self._points
        if not points:
            return 1.0
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, s0), (r1, s1) in zip(points, points[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0) if r1 > r0 else s1
        return points[-1][1]


@dataclass
class StepCost:
    """The curves a plan reads: `speculating`, what a step that verifies drafts and may run the drafter
    after it costs (its wall time where it is read back at once, as `EngineCore.step` times it; queued
    behind another, its forward, sampling and drafter on the device's clock); `plain`, what a step
    without them costs (its forward and sampling on the device's clock when async scheduling hides the
    host's work, else its wall time without the drafter's)."""

    speculating: TimeCurve = field(default_factory=TimeCurve)
    plain: TimeCurve = field(default_factory=TimeCurve)


@dataclass
class Exploration:
    """When an engine that runs plain steps tries its drafter again. Plain steps verify nothing, so the
    hold rates that made the engine plain never move: without probes it would stay plain for good, even
    where its text turns predictable (an agent's session reaching a file it quotes back, a drafter
    judged on a hard stretch). Once the plain steps since the last speculative one took 1 / `share`
    times what a probe costs, the next step probes: every draft the drafter makes is verified, whatever
    the plan says (a device drafter drafts after that step and the next verifies them all), which is
    the evidence the rates need. A probe halves `share` (the next waits twice as long) and a step that
    the plan made speculative restores it, so drafts that never hold cost at most PROBE_SHARE of the
    plain time until the first probe, half that until the next, and so on."""

    share: float = PROBE_SHARE
    plain_seconds: float = 0.0  # plain steps' time since the last speculative step

    def due(self, probe_seconds: float) -> bool:
        return self.plain_seconds * self.share >= probe_seconds

    def observe(self, speculative: bool, plain_seconds: float) -> None:
        """A decode step ran: a plain one's time counts towards the next probe, a speculative one's
        restarts the count."""
        self.plain_seconds = 0.0 if speculative else self.plain_seconds + plain_seconds

    def probed(self) -> None:
        self.share /= 2
        self.plain_seconds = 0.0

    def paid(self) -> None:
        """The plan chose to speculate: drafts pay again, and probes may cost their full share."""
        self.share = PROBE_SHARE


def plan_verify(base_rows: int, base_tokens: int, survivals: list[list[float]],
                speculating: Callable[[int], float], plain: Callable[[int], float]) -> list[int]:
    """How many drafts each sequence verifies: `survivals[i]` are sequence i's a_1 .. a_k
    (non-increasing), `base_rows` the step's rows without drafts, `base_tokens` the tokens it yields
    without them (one per chunk that samples), `speculating(rows)` and `plain(rows)` the two kinds of
    step's time. Admits drafts most likely first and keeps the count whose expected tokens per second is
    highest, a plain step's being the count 0 (ties: fewer rows)."""
    ranked = sorted(((a, i) for i, row in enumerate(survivals) for a in row), key=itemgetter(0), reverse=True)  # stable
    expected = float(base_tokens)
    best_rate = expected / plain(base_rows)
    admitted = 0
    for count, (a, _) in enumerate(ranked, start=1):
        expected += a
        rate = expected / speculating(base_rows + count)
        if rate > best_rate:
            best_rate, admitted = rate, count
    lengths = [0] * len(survivals)
    for _, i in ranked[:admitted]:
        lengths[i] += 1
    return lengths
