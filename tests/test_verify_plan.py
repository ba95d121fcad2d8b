"""Throughput-aware verification (`deepinfer.engine.verify_plan`): the plan admits the likeliest drafts
while they raise the step's expected tokens per second, each sequence's a prefix of its own; hold
rates learn from verifications; the step-time curve is the median of what ran; and in the engine it
changes how many drafts are verified, never the outputs, and stops verifying drafts that never hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer import LLM, EngineConfig
from deepinfer.errors import DeepInferError
from deepinfer.engine.verify_plan import PRIOR_HOLD, HoldRates, StepCost, plan_verify
from deepinfer.harness.invariance import signature, standard_requests


def _flat(rows: int) -> float:
    return 1.0


def _per_row(rows: int) -> float:
    return float(rows)


survival_rows = st.lists(st.floats(0.0, 1.0), max_size=6).map(lambda row: sorted(row, reverse=True))


@given(base=st.integers(1, 64), survivals=st.lists(survival_rows, max_size=6))
def test_a_plan_admits_the_likeliest_drafts_as_each_sequences_prefix(base, survivals) -> None:
    lengths = plan_verify(base, base, survivals, lambda rows: 1.0 + 0.01 * rows)
    assert all(0 <= n <= len(row) for n, row in zip(lengths, survivals))
    admitted = [a for row, n in zip(survivals, lengths) for a in row[:n]]
    declined = [a for row, n in zip(survivals, lengths) for a in row[n:]]
    assert not admitted or not declined or min(admitted) >= max(declined)


def test_free_rows_verify_every_draft_and_costly_ones_only_what_pays() -> None:
    survivals = [[0.9, 0.8, 0.5], [0.2, 0.01]]
    assert plan_verify(2, 2, survivals, _flat) == [3, 2]
    assert plan_verify(2, 2, survivals, _per_row) == [0, 0]  # a row costs as much as the token it may add
    # a draft pays while its survival beats what its row costs in tokens per second: at a tenth of a
    # step per row the 0.2 draft does not (4.4 tokens in 1.6 against 4.2 in 1.5), at a twentieth it does
    assert plan_verify(2, 2, survivals, lambda rows: 1 + 0.1 * rows) == [3, 0]
    assert plan_verify(2, 2, survivals, lambda rows: 1 + 0.05 * rows) == [3, 1]


def test_hold_rates_learn_which_positions_hold() -> None:
    rates = HoldRates()
    assert rates.survivals(2) == [PRIOR_HOLD, PRIOR_HOLD**2]
    rates.observe(verified=3, kept=1)  # the first held, the second failed, the third was not reached
    assert rates.rates[0] > PRIOR_HOLD > rates.rates[1] and len(rates.rates) == 2
    for _ in range(20):
        rates.observe(verified=2, kept=0)
    assert rates.survivals(3)[0] < 0.01 and rates.survivals(3)[2] <= rates.survivals(3)[1] <= rates.survivals(3)[0]


def test_step_cost_is_the_median_of_what_ran_and_flat_where_nothing_did() -> None:
    cost = StepCost()
    assert cost.seconds(1) == cost.seconds(100) == 1.0
    for seconds in (0.010, 0.011, 0.500):  # one outlier: the median keeps the bucket's typical step
        cost.observe(1, seconds)
    for seconds in (0.020, 0.021, 0.019):
        cost.observe(9, seconds)
    assert cost.seconds(1) == 0.011 and cost.seconds(9) == 0.020
    assert cost.seconds(5) == pytest.approx(0.011 + (0.020 - 0.011) * 4 / 8)
    assert cost.seconds(64) == 0.020


@pytest.fixture(scope="module")
def requests():
    return standard_requests(vocab_size=1024, count=12)


def _serve(requests, preset: str = "tiny", **settings) -> tuple[list[tuple], LLM]:
    llm = LLM(f"preset:{preset}", max_num_seqs=4, **settings)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    return [signature(o) for o in outputs], llm


@pytest.mark.parametrize("preset, speculation", [("tiny", "ngram"), ("v41-tiny", "dspark")])
def test_throughput_aware_verification_changes_draft_counts_never_outputs(requests, preset, speculation) -> None:
    """Against `fixed`, whose outputs are plain decoding's (tests/test_speculation.py, test_dspark_engine.py)."""
    requests = requests if preset == "tiny" else requests[:6]
    fixed, fixed_llm = _serve(requests, preset, speculation=speculation, verify_policy="fixed")
    planned, llm = _serve(requests, preset, speculation=speculation, verify_policy="throughput")
    assert planned == fixed
    assert fixed_llm.core.scheduler.num_drafts_declined == 0 and llm.core.scheduler.step_cost is not None
    assert llm.core.scheduler.num_drafts_declined + llm.core.scheduler.num_drafted == fixed_llm.core.scheduler.num_drafted


def test_drafts_that_never_hold_stop_being_verified(requests, monkeypatch) -> None:
    """A drafter whose drafts never hold (a random-weight target): once the hold rates have fallen, decode
    steps whose rows cost what they may earn verify no drafts, and the outputs stay those of plain
    decoding. (A step carrying a long prefill may still verify some: there a row costs next to nothing.)"""
    requests = [r for r in requests if len(r.prompt) <= 70]  # every prompt computed in the first step
    llm = LLM("preset:tiny", max_num_seqs=8, speculation="ngram", verify_policy="throughput")
    scheduler = llm.core.scheduler
    monkeypatch.setattr(scheduler.step_cost, "seconds", lambda rows: 1.0 + 0.25 * rows)
    monkeypatch.setattr(scheduler.drafter, "propose", lambda seq, limit: [1] * limit)  # token 1 never comes
    verified = []
    original = scheduler._plan_verification

    def recording(chunks):
        freed = original(chunks)
        verified.append(sum(chunk.num_draft for chunk in chunks))
        return freed

    monkeypatch.setattr(scheduler, "_plan_verification", recording)
    outputs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    assert [signature(o) for o in outputs] == _serve(requests)[0]
    assert verified[1] > 0 and not any(verified[4:])
    assert llm.core.scheduler.drafter_holds.survivals(1)[0] < 0.2 and llm.core.scheduler.num_draft_kept == 0


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
