"""Throughput-aware verification (`deepinfer.engine.verify_plan`): the plan admits the likeliest drafts
while they raise the step's expected tokens per second above a plain step's, each sequence's a prefix of
its own; hold rates learn from verifications; the step-time curves are the medians of what ran; and in
the engine it changes how many drafts are verified and which steps speculate, never the outputs, and an
engine whose drafts never hold runs plain steps (async scheduling, no drafter) on its own."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer import LLM, EngineConfig
from deepinfer.errors import DeepInferError
from deepinfer.engine.verify_plan import (DRAFTER_PRIOR, PRIOR_HOLD, PROBE_SHARE, Exploration, HeadLevels, HoldRates,
                                          TimeCurve, confidences, plan_verify)
from deepinfer.harness.invariance import ReferenceDrafter, signature, standard_requests


def _flat(rows: int) -> float:
    return 1.0


def _per_row(rows: int) -> float:
    return float(rows)


survival_rows = st.lists(st.floats(0.0, 1.0), max_size=6).map(lambda row: sorted(row, reverse=True))


@given(base=st.integers(1, 64), survivals=st.lists(survival_rows, max_size=6))
def test_a_plan_admits_the_likeliest_drafts_as_each_sequences_prefix(base, survivals) -> None:
    cost = lambda rows: 1.0 + 0.01 * rows  # noqa: E731
    lengths = plan_verify(base, base, survivals, cost, cost)
    assert all(0 <= n <= len(row) for n, row in zip(lengths, survivals))
    admitted = [a for row, n in zip(survivals, lengths) for a in row[:n]]
    declined = [a for row, n in zip(survivals, lengths) for a in row[n:]]
    assert not admitted or not declined or min(admitted) >= max(declined)


def test_free_rows_verify_every_draft_and_costly_ones_only_what_pays() -> None:
    survivals = [[0.9, 0.8, 0.5], [0.2, 0.01]]
    assert plan_verify(2, 2, survivals, _flat, _flat) == [3, 2]
    assert plan_verify(2, 2, survivals, _per_row, _per_row) == [0, 0]  # a row costs as much as the token it may add
    # a draft pays while its survival beats what its row costs in tokens per second: at a tenth of a
    # step per row the 0.2 draft does not (4.4 tokens in 1.6 against 4.2 in 1.5), at a twentieth it does
    tenth, twentieth = (lambda rows: 1 + 0.1 * rows), (lambda rows: 1 + 0.05 * rows)
    assert plan_verify(2, 2, survivals, tenth, tenth) == [3, 0]
    assert plan_verify(2, 2, survivals, twentieth, twentieth) == [3, 1]


def test_speculating_must_beat_a_plain_step() -> None:
    """A speculative step also runs the drafter and is read back at once: drafts pay only if the
    tokens they are expected to add beat that, against a plain step's tokens per second."""
    speculating = lambda rows: 1.5  # noqa: E731 - half a plain step more, however many rows
    assert plan_verify(1, 1, [[0.3, 0.1]], speculating, _flat) == [0]  # 1.4 tokens in 1.5 < 1 in 1
    assert plan_verify(1, 1, [[0.3, 0.1]], speculating, lambda rows: 1.2) == [2]  # 1.4 / 1.5 > 1 / 1.2
    assert plan_verify(1, 1, [[0.9, 0.8, 0.5]], speculating, _flat) == [3]
    assert plan_verify(1, 1, [[0.5]], speculating, _flat) == [0]  # a tie stays plain


def test_hold_rates_learn_which_positions_hold() -> None:
    rates = HoldRates()
    assert rates.survivals(2) == [PRIOR_HOLD, PRIOR_HOLD**2]
    rates.observe(verified=3, kept=1)  # the first held, the second failed, the third was not reached
    assert rates.rate(0) == 1.0 and rates.rate(1) == 0.0 and rates.rate(2) == PRIOR_HOLD
    for _ in range(20):
        rates.observe(verified=2, kept=0)
    survivals = rates.survivals(3)
    assert survivals[0] < 0.01 and survivals[2] <= survivals[1] <= survivals[0]


def test_a_drafter_learns_from_a_whole_batch_in_one_step() -> None:
    """Sixteen sequences whose first drafts all fail: after one step the drafter's rate, and through it
    each sequence's, is near nothing (a lone sequence's would still be 0.2); a step of drafts that held
    brings it past even, and a few more near certainty."""
    batch, lone = HoldRates(prior=DRAFTER_PRIOR), HoldRates(prior=DRAFTER_PRIOR)
    batch.observe_step([(5, 0)] * 16)
    lone.observe_step([(5, 0)])
    seq = HoldRates()
    seq.observe(5, 0)
    assert seq.rate(0, batch) < 0.03 < 0.2 < seq.rate(0, lone)
    assert HoldRates().rate(0, batch) == batch.rate(0) < 0.04  # a new sequence starts from its drafter's
    batch.observe_step([(5, 5)] * 16)
    assert batch.rate(0) > 0.5
    for _ in range(3):
        batch.observe_step([(5, 5)] * 16)
    assert batch.rate(0) > 0.9 and batch.rate(4) > 0.9


@given(steps=st.lists(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), max_size=8), max_size=12))
def test_hold_rates_are_chances(steps) -> None:
    drafter, seq = HoldRates(prior=DRAFTER_PRIOR), HoldRates()
    for step in steps:
        step = [(verified, min(kept, verified)) for verified, kept in step]
        drafter.observe_step(step)
        for verified, kept in step[:1]:
            seq.observe(verified, kept)
        survivals = seq.survivals(5, drafter)
        assert all(0.0 <= a <= 1.0 for a in survivals) and survivals == sorted(survivals, reverse=True)


@given(steps=st.lists(st.tuples(st.booleans(), st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), max_size=4)),
                      max_size=12))
def test_survivals_asked_again_are_those_of_the_records_as_they_are_now(steps) -> None:
    """A plan asks for every running sequence's survivals in each step, and they are kept between
    rounds of evidence: after any mix of rounds taken by the sequence, by its drafter or by neither, what
    comes back is what records rebuilt from the same counts compute."""
    drafter, seq = HoldRates(prior=DRAFTER_PRIOR), HoldRates()
    for own, step in steps:
        step = [(verified, min(kept, verified)) for verified, kept in step]
        if step:
            drafter.observe_step(step)
        if own and step:
            seq.observe(*step[0])
        rebuilt = HoldRates(seq.held[:], seq.tried[:]), HoldRates(drafter.held[:], drafter.tried[:], drafter.prior)
        assert seq.survivals(5, drafter) == rebuilt[0].survivals(5, rebuilt[1])


def test_a_step_that_verified_nothing_is_no_round_of_evidence() -> None:
    """The scheduler hands the drafter's record every step's verifications, none in a plain step: that
    changes no count, so the survivals a plan asks for again are the ones kept, not computed anew."""
    drafter, seq = HoldRates(prior=DRAFTER_PRIOR), HoldRates()
    drafter.observe_step([(3, 1), (2, 2)])
    seq.observe(3, 1)
    kept = seq.survivals(5, drafter)
    before = (drafter.rounds, drafter.held[:], drafter.tried[:])
    drafter.observe_step([])
    drafter.observe_step([(0, 0)])
    assert (drafter.rounds, drafter.held, drafter.tried) == before
    assert seq.survivals(5, drafter) is kept


def test_a_heads_confidence_counts_against_its_level_where_verification_reached() -> None:
    """The head is read relative to its mean confidence in the drafts verification reached at that
    position: not at all before any did, and a head off by a constant factor reads as a calibrated one."""
    assert confidences([0.5, 0.25, 0.0, 0.0]) == [0.5, 0.5, 0.0, 0.0]
    levels, tenth = HeadLevels(), HeadLevels()
    assert levels.relative(0, 0.01) == 1.0  # no verification yet: the drafter is tried before it is judged
    for block, verified, kept in [([0.6, 0.4, 0.2], 3, 0), ([0.2, 0.8, 0.5], 3, 3), ([0.4, 0.6], 2, 1)]:
        levels.observe_step([(block, verified, kept)])
        tenth.observe_step([([c / 10 for c in block], verified, kept)])
    assert levels.relative(2, 0.5) == 1.0 and levels.counts[2] == 1.0  # one verification reached slot 2
    assert levels.relative(0, 0.8) > 1.0 > levels.relative(0, 0.2) > levels.relative(0, 0.0) == 0.0
    for j, c in [(0, 0.7), (1, 0.3), (2, 0.9)]:
        assert tenth.relative(j, c / 10) == pytest.approx(levels.relative(j, c))
    levels.observe_step([([0.0, 0.0], 2, 1)])
    assert HeadLevels().relative(0, 0.3) == 1.0 and levels.relative(0, 0.3) > 0.0


def test_a_time_curve_is_the_median_of_what_ran_and_flat_where_nothing_did() -> None:
    cost = TimeCurve()
    assert cost.seconds(1) == cost.seconds(100) == 1.0
    for seconds in (0.010, 0.011, 0.500):  # one outlier: the median keeps the bucket's typical step
        cost.observe(1, seconds)
    for seconds in (0.020, 0.021, 0.019):
        cost.observe(9, seconds)
    assert cost.seconds(1) == 0.011 and cost.seconds(9) == 0.020
    assert cost.seconds(5) == pytest.approx(0.011 + (0.020 - 0.011) * 4 / 8)
    assert cost.seconds(64) == 0.020


@given(probe=st.floats(0.01, 50.0), plain=st.lists(st.floats(0.001, 2.0), max_size=3000), speculating=st.sets(st.integers(0, 2999)))
def test_probes_cost_a_bounded_share_of_the_plain_time(probe, plain, speculating) -> None:
    """Probes while drafts never hold cost at most PROBE_SHARE of the plain steps' time: each waits for
    plain time worth 1 / share times its cost and halves the share; a step the plan made speculative
    restores the share, and restarts the wait."""
    exploration, spent, since = Exploration(), 0.0, 0.0
    for step, seconds in enumerate(plain):
        if step in speculating:
            exploration.paid()
            exploration.observe(True, seconds)
            spent, since = 0.0, 0.0
        elif exploration.due(probe):
            exploration.probed()
            spent += probe
            assert spent <= PROBE_SHARE * since * (1 + 1e-9)
        else:
            exploration.observe(False, seconds)
            since += seconds
    if not speculating and sum(plain) >= 2 * probe / PROBE_SHARE:
        assert spent > 0


def _requests() -> list:
    return standard_requests(vocab_size=1024, count=12)


@pytest.fixture(scope="module")
def requests():
    return _requests()


@functools.cache
def _plain(preset: str, count: int) -> list[tuple]:
    """Plain decoding's signatures of the first `count` requests (served once per module)."""
    return _serve(_requests()[:count], preset)[0]


def _serve(requests, preset: str = "tiny", drafter=None, **settings) -> tuple[list[tuple], LLM]:
    """Signatures of `requests` served by a new engine (with `drafter` in place of its own, if given)."""
    llm = LLM(f"preset:{preset}", max_num_seqs=4, **settings)
    if drafter is not None:
        llm.core.scheduler.drafter = drafter
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    return [signature(o) for o in outputs], llm


@pytest.mark.parametrize("preset, speculation", [("tiny", "ngram"), ("v41-tiny", "dspark")])
def test_throughput_aware_verification_changes_draft_counts_never_outputs(requests, preset, speculation) -> None:
    """Against `fixed`, whose outputs are plain decoding's (tests/test_speculation.py, test_dspark_engine.py).
    Prompt lookup finds little in these random prompts (the policy soon stops asking it), so drafts that
    often hold stand in for it: the policy then has drafts to weigh whatever the step times."""
    requests = requests if preset == "tiny" else requests[:6]
    fixed, fixed_llm = _serve(requests, preset, speculation=speculation, verify_policy="fixed")
    drafter = None
    if speculation == "ngram":
        drafter = ReferenceDrafter([r.prompt + list(s[0]) for r, s in zip(requests, fixed)], wrong_every=3)
    planned, llm = _serve(requests, preset, drafter, speculation=speculation, verify_policy="throughput")
    assert planned == fixed
    assert fixed_llm.core.scheduler.num_drafts_declined == 0 and llm.core.scheduler.step_cost is not None
    assert llm.core.scheduler.num_drafts_declined + llm.core.scheduler.num_drafted > 0
    # each verified draft was expected to hold with a chance in (0, 1]; `fixed` plans nothing
    scheduler = llm.core.scheduler
    assert scheduler.num_drafts_expected <= scheduler.num_drafted
    assert (scheduler.num_drafts_expected > 0) == (scheduler.num_drafted > 0)
    assert fixed_llm.core.scheduler.num_drafts_expected == 0


class _EagerGraph:
    """Stands in for `engine.graph.StepGraph` on the CPU: captures nothing, runs the forward when replayed;
    `made` counts the graphs made."""

    made = 0

    def __init__(self, model, caches, batch, pool, tap_streams) -> None:
        type(self).made += 1
        self.model, self.caches, self.batch, self.streams_at = model, caches, batch, {}

    def replay(self, batch):
        return self.model(batch, self.caches)


def test_only_decode_steps_that_capture_no_graph_teach_the_step_times(requests, monkeypatch) -> None:
    """The curves price decode steps with and without drafts. A step holding a prompt's chunk runs eagerly
    and costs what the prompt does (the first one is speculative: the optimistic prior has the drafter run
    after it), and a step that captures a CUDA graph costs the capture: neither may teach them. Graphs are
    stood in for by eager forwards counted as captures, so the CPU makes every kind of step."""
    monkeypatch.setattr("deepinfer.engine.runner.StepGraph", _EagerGraph)
    requests = requests[:4]
    fixed, _ = _serve(requests, speculation="ngram", verify_policy="fixed")
    llm = LLM("preset:tiny", max_num_seqs=4, speculation="ngram", verify_policy="throughput")
    scheduler, runner = llm.core.scheduler, llm.core.runner
    scheduler.drafter = ReferenceDrafter([r.prompt + list(s[0]) for r, s in zip(requests, fixed)], wrong_every=3)
    runner.graphs, runner.graph_pool = {}, None
    taught, steps = [], []
    for kind, curve in (("speculating", scheduler.step_cost.speculating), ("plain", scheduler.step_cost.plain)):
        monkeypatch.setattr(curve, "observe", lambda rows, seconds, kind=kind: taught.append((kind, rows)))
    execute = runner.execute

    def recording_execute(scheduled, in_flight=None):
        made = _EagerGraph.made
        out = execute(scheduled, in_flight)
        rows = sum(chunk.num_tokens for chunk in scheduled.chunks)
        steps.append((rows, scheduled.decodes_only, scheduled.speculative, _EagerGraph.made > made))
        return out
    monkeypatch.setattr(runner, "execute", recording_execute)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    assert [signature(o) for o in outputs] == fixed
    assert any(speculative and not decode for _, decode, speculative, _ in steps)
    assert any(captured for *_, captured in steps) and any(not captured for *_, captured in steps)
    expected = [(kind, rows) for rows, decode, speculative, captured in steps if decode and not captured
                for kind in (("plain", "speculating") if speculative else ("plain",))]
    assert taught == expected and any(kind == "speculating" for kind, _ in taught)


def test_a_drafters_doubt_lowers_what_a_step_verifies(requests, monkeypatch) -> None:
    """DSpark's confidence head hands each block's survivals to the host (the chance that its first j
    drafts all hold: the running product of its confidences, one per draft, never rising); the plan
    scales each sequence's learnt rates by the head's confidence relative to its level. So a head whose
    confidences are all ten times too low verifies what the real head does, and one that doubts some
    sequences' blocks entirely (confidence 0) verifies theirs only before any verification said what its
    confidences mean, while the others' go on being verified. Outputs are plain decoding's throughout.
    A row costs the same in either kind of step here, so what is verified does not depend on this
    machine's speed. Steps are read back at once: a step queued behind a speculative one plans drafts
    still on the device, whose confidences the host has not seen, by the learnt rates alone."""
    requests = requests[:6]

    def engine(survivals=None) -> tuple[LLM, list[list[tuple[int, int]]]]:
        """An engine whose head's survivals pass through `survivals(seq, real)`, and per step the
        (request id, drafts verified) of its verifying chunks."""
        llm = LLM("preset:v41-tiny", max_num_seqs=4, speculation="dspark", verify_policy="throughput",
                  async_scheduling=False)
        scheduler, verified = llm.core.scheduler, []
        for curve in (scheduler.step_cost.speculating, scheduler.step_cost.plain):
            monkeypatch.setattr(curve, "seconds", lambda rows: 1.0 + 0.01 * rows)
        if survivals is not None:
            real = scheduler.drafter.survivals
            monkeypatch.setattr(scheduler.drafter, "survivals", lambda seq: survivals(seq, real(seq)))
        schedule = scheduler.schedule

        def recording_schedule():
            out = schedule()
            verified.append([(c.seq.request_id, c.num_draft) for c in out.chunks if c.num_draft])
            return out
        monkeypatch.setattr(scheduler, "schedule", recording_schedule)
        outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
        assert [signature(o) for o in outputs] == _plain("v41-tiny", len(requests))
        return llm, verified

    observed = []
    llm, real = engine(lambda seq, survivals: observed.append(survivals) or survivals)
    assert observed and all(len(survivals) == 5 for survivals in observed if survivals is not None)
    assert all(1 >= a >= b >= 0 for s in observed if s is not None for a, b in zip(s, s[1:] + [0]))
    assert llm.core.scheduler.num_drafted > 0

    _, tenth = engine(lambda seq, survivals: survivals and [a * 0.1 ** (j + 1) for j, a in enumerate(survivals)])
    assert tenth == real

    _, partly = engine(lambda seq, survivals: survivals and ([0.0] * len(survivals) if seq.request_id % 2
                                                             else survivals))
    first = next(i for i, step in enumerate(partly) if step)
    assert all(request % 2 == 0 for step in partly[first + 1:] for request, _ in step)
    assert any(step for step in partly[first + 1:])


def _recording_steps(llm: LLM, monkeypatch) -> list[tuple[bool, bool]]:
    """Per engine step: (whether it was speculative, whether it was left in flight)."""
    core, steps = llm.core, []
    schedule, step = core.scheduler.schedule, core.step

    def recording_step():
        out = step()
        steps[-1] = (steps[-1][0], core.in_flight is not None)
        return out

    def recording_schedule():
        scheduled = schedule()
        steps.append((scheduled.speculative, False))
        return scheduled

    monkeypatch.setattr(core.scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(core, "step", recording_step)
    return steps


@pytest.mark.parametrize("preset, speculation", [("tiny", "ngram"), ("v41-tiny", "dspark")])
def test_drafts_that_never_hold_leave_the_engine_plain(requests, preset, speculation, monkeypatch) -> None:
    """A drafter whose drafts never hold (a random-weight target): once the hold rates have fallen, steps
    are plain: they verify nothing, the device drafter no longer runs, and async scheduling queues each
    step before the one before it is read. Outputs stay those of plain decoding. The step times are
    fixed here (a speculative step costs twice a plain one), so when that happens does not depend on
    this machine's speed."""
    requests = requests[:6]
    llm = LLM(f"preset:{preset}", max_num_seqs=4, speculation=speculation, verify_policy="throughput")
    scheduler = llm.core.scheduler
    monkeypatch.setattr(scheduler.step_cost.speculating, "seconds", lambda rows: 2.0 + 0.01 * rows)
    monkeypatch.setattr(scheduler.step_cost.plain, "seconds", lambda rows: 1.0 + 0.01 * rows)
    drafter_runs = []
    if speculation == "ngram":
        monkeypatch.setattr(scheduler.drafter, "propose", lambda seq, limit: [1] * limit)  # token 1 never comes
    else:
        run = llm.core.runner.drafts.run
        monkeypatch.setattr(llm.core.runner.drafts, "run", lambda step: drafter_runs.append(1) or run(step))
    steps = _recording_steps(llm, monkeypatch)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    assert [signature(o) for o in outputs] == _plain(preset, len(requests))
    speculative = [s for s, _ in steps]
    assert speculative[0] and scheduler.num_drafted + scheduler.num_drafts_declined > 0
    assert scheduler.num_draft_kept <= scheduler.num_drafted // 10
    last = max(i for i, s in enumerate(speculative) if s)
    assert last < len(steps) // 3 and not any(speculative[last:][1:])
    assert sum(in_flight for _, in_flight in steps[last + 1:]) >= len(steps[last + 1:]) - 2
    if drafter_runs:
        assert len(drafter_runs) == scheduler.num_speculating_steps == last + 1 - speculative[:last + 1].count(False)


class _LateDrafter(ReferenceDrafter):
    """Prompt lookup whose drafts never hold (token 1 never comes) until a sequence has `late` tokens past
    its prompt, and hold from then on (the reference's continuations)."""

    def __init__(self, streams: list[list[int]], late: int) -> None:
        super().__init__(streams, wrong_every=10**6)
        self.late = late

    def propose(self, seq, limit: int) -> list[int]:
        if len(seq.known_token_ids) - len(seq.prompt_token_ids) < self.late:
            return [1] * limit
        return super().propose(seq, limit)


@functools.cache
def _long_requests() -> tuple[list, list[tuple]]:
    """Two requests of 70 tokens and plain decoding's signatures of them."""
    requests = standard_requests(vocab_size=1024, count=2, max_tokens=70)
    return requests, _serve(requests)[0]


@pytest.mark.parametrize("share, queued", [(0.5, False), (0.5, True), (0.0, False)])
def test_an_engine_left_plain_probes_its_drafter_and_speculates_again_once_drafts_hold(share, queued,
                                                                                       monkeypatch) -> None:
    """Drafts that fail at first leave the engine plain, and plain steps teach the rates nothing; probes
    (`Exploration`: every draft verified once plain steps worth 1 / share times a probe's cost have
    run) find that the drafts hold now, and the engine speculates again. With no share for probes (the
    control) it stays plain. Under async scheduling the lookup drafts past a step in flight, and
    candidates that fail to predict its draws are dropped on the device: the draws count as their
    verification (`Scheduler._foreseen`), or the engine would never learn that they fail. Step times
    are fixed (a speculative step costs twice a plain one); outputs are plain decoding's either way."""
    requests, fixed = _long_requests()
    monkeypatch.setattr("deepinfer.engine.verify_plan.PROBE_SHARE", share)
    llm = LLM("preset:tiny", max_num_seqs=4, speculation="ngram", verify_policy="throughput", async_scheduling=queued)
    scheduler = llm.core.scheduler
    scheduler.exploration = exploration = Exploration(share=share)
    # a plain step's time counts towards a probe as the fixed curve prices it
    monkeypatch.setattr(exploration, "observe", lambda speculative, _: Exploration.observe(exploration, speculative, 1.0))
    scheduler.drafter = _LateDrafter([r.prompt + list(s[0]) for r, s in zip(requests, fixed)], late=20)
    monkeypatch.setattr(scheduler.step_cost.speculating, "seconds", lambda rows: 2.0 + 0.01 * rows)
    monkeypatch.setattr(scheduler.step_cost.plain, "seconds", lambda rows: 1.0 + 0.01 * rows)
    kept = []
    update = scheduler.update

    def recording_update(scheduled, result):
        before = scheduler.num_draft_kept
        out = update(scheduled, result)
        kept.append(scheduler.num_draft_kept - before)
        return out
    monkeypatch.setattr(scheduler, "update", recording_update)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    assert [signature(o) for o in outputs] == fixed
    assert sum(kept[:15]) == 0  # the early drafts never held
    if share:
        assert scheduler.num_probes >= 1 and sum(kept) >= 30
        assert sum(k > 0 for k in kept[-12:]) >= 6  # speculating again to the end
    else:
        assert scheduler.num_probes == 0 and sum(kept) == 0


def test_a_drafter_that_never_drafts_leaves_the_engine_plain(requests, monkeypatch) -> None:
    """Prompt lookup that finds nothing: no draft is ever verified, so the hold rates never move, but the
    chance that the drafter drafts at all falls in the steps that gave it the chance, and the engine
    turns plain (async scheduling) as it does when drafts fail."""
    requests = requests[:6]
    llm = LLM("preset:tiny", max_num_seqs=4, speculation="ngram", verify_policy="throughput")
    scheduler = llm.core.scheduler
    monkeypatch.setattr(scheduler.step_cost.speculating, "seconds", lambda rows: 2.0 + 0.01 * rows)
    monkeypatch.setattr(scheduler.step_cost.plain, "seconds", lambda rows: 1.0 + 0.01 * rows)
    monkeypatch.setattr(scheduler.drafter, "propose", lambda seq, limit: [])
    steps = _recording_steps(llm, monkeypatch)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    assert [signature(o) for o in outputs] == _plain("tiny", len(requests))
    speculative = [s for s, _ in steps]
    last = max(i for i, s in enumerate(speculative) if s)
    assert scheduler.num_drafted == 0 and last < len(steps) // 3 and not any(speculative[last:][1:])
    assert sum(in_flight for _, in_flight in steps[last + 1:]) >= len(steps[last + 1:]) - 2
    assert scheduler.drafter_proposes.rate(0) < PRIOR_HOLD / 4


@pytest.mark.parametrize("preset, speculation", [("tiny", "ngram"), ("v41-tiny", "dspark")])
def test_any_mix_of_plain_and_speculative_steps_keeps_the_outputs(requests, preset, speculation, monkeypatch) -> None:
    """Whatever the policy decides, step by step (here: at random), outputs are plain decoding's: plain steps
    left in flight hand placeholders to the speculative steps after them, the device drafter skips plain
    steps (its context rows there are never written: later drafts may suffer, outputs cannot), and every
    verify length is exercised."""
    requests = requests[:6]
    plain = _plain(preset, len(requests))
    llm = LLM(f"preset:{preset}", max_num_seqs=4, speculation=speculation, verify_policy="throughput")
    scheduler, rng = llm.core.scheduler, random.Random(11)
    if speculation == "ngram":  # drafts that often hold, so that kept and failed drafts both follow plain steps
        scheduler.drafter = ReferenceDrafter([r.prompt + list(s[0]) for r, s in zip(requests, plain)], wrong_every=4)
    monkeypatch.setattr(scheduler, "_drafting_pays", lambda chunks: rng.random() < 0.4)
    monkeypatch.setattr(scheduler, "_plan", lambda rows, tokens, survivals:
                        [rng.randint(0, len(row)) if rng.random() < 0.5 else 0 for row in survivals])
    steps = _recording_steps(llm, monkeypatch)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    assert [signature(o) for o in outputs] == plain
    in_flight_then_speculative = sum(a[1] and b[0] for a, b in zip(steps, steps[1:]))
    assert in_flight_then_speculative >= 2 and scheduler.num_drafted > 0 and len(scheduler.verify_lengths) >= 3


@pytest.mark.parametrize("settings, message", [
    ({"verify_policy": "greedy"}, "unknown verify_policy 'greedy' (expected one of fixed, throughput)"),
    ({"verify_policy": "throughput", "expert_parallel": 2},
     "verify_policy=throughput decides from this process's own step times, which the other processes of a "
     "parallel layout do not share: use fixed with expert, data or context parallelism"),
])
def test_bad_verify_settings_are_refused(settings, message) -> None:
    with pytest.raises(DeepInferError) as err:
        EngineConfig(**settings)
    assert str(err.value) == message
