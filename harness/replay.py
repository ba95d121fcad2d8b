"""Replaying agent episodes through the engine, and judging each replay.

Two modes:
- teacher-forced: every assistant turn is regenerated from the recorded history; the turns of all
  episodes are independent, so they are served as one batch.
- free-running: the model's own turns feed forward, as a client would send them back: the recipe parses
  each generated turn into the client's response shape, its entries extend the conversation, and the
  next turn is the recipe's encoding of that request body. After a turn with tool calls a `ToolStub`
  answers each call from the trace (matched by tool name and canonical JSON arguments); after a turn
  without calls the trace's next user entries follow, and when there are none the episode is complete.
  A call the trace did not record ends the episode at that turn. Episodes run in lockstep, one batch
  per round.

Each replay is judged against a reference, giving one `EpisodeResult` per episode: against the trace
itself (`against_trace`: teacher-forced turns are compared token by token with the trace's own
assistant turns; free-running episodes report how they ended) or against a recording of an earlier
replay (`against_recording`: the first turn, token and top-2 margins where the two differ).

A turn's prompt usually extends the previous turn's prompt; `prefill_cost` measures how much of the
prefill repeats, and the engine's prefix cache (on by default) computes each shared prefix once:
the turns are submitted together, and a turn waits while another computes the blocks it shares.

Progress (deepinfer.progress; `progress=False` silences it) counts teacher-forced turns and
free-running episodes as they finish: a bar on a terminal, a status line every 10 s when piped.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import polars as pl

from deepinfer.audit.compare import compare_streams
from deepinfer.audit.streams import STREAM_SCHEMA, stream_hashes
from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.progress import Progress
from deepinfer.harness.suite_base import SuiteRequest, generated_fields
from deepinfer.harness.trace_bodies import CONVERSATION, recorded_message, response_calls, response_entries, tool_outputs
from deepinfer.harness.traces import Episode, RecordedTurn, Recording, ToolResult, canonical_arguments, turn_request_id

MODES = ("teacher-forced", "free-running")
STATUSES = ("identical", "completed", "diverged", "unrecorded_call", "error", "malformed", "altered")
_COMPARED_COLUMNS = ("index", "request_id", "prompt_token_ids", "token_ids", "logprobs", "top_token_ids",
                     "top_logprobs", "finish_reason", "error_kind", "error")


@dataclass(frozen=True)
class EpisodeResult:
    """How one episode's replay compares with its reference. `turn` counts from 1, `token` (a position
    in that turn's output) from 0; margins are top-1 minus top-2 logprob there, of the replay and of
    the recording."""

    episode_id: str
    status: str
    turn: int | None = None
    token: int | None = None
    margin: float | None = None
    recorded_margin: float | None = None
    near_tie: bool = False
    detail: str = ""
    refused_turn: int | None = None  # a later turn whose prompt the engine refused, ending the episode there

    def describe(self) -> str:
        if self.status in ("identical", "completed"):
            return f"{self.episode_id}: {self.status}" + (f" ({self.detail})" if self.detail else "")
        if self.status == "unrecorded_call":
            return f"{self.episode_id}: diverged at turn {self.turn} ({self.detail})"
        if self.status == "diverged":
            if self.token is None:
                return f"{self.episode_id}: diverged at turn {self.turn}: {self.detail}"
            margins = [f"margin {_number(self.margin)}"]
            if self.recorded_margin is not None:
                margins.append(f"recorded margin {_number(self.recorded_margin)}")
            if self.near_tie:
                margins.append("near-tie")
            return (f"{self.episode_id}: diverged at turn {self.turn} token {self.token} ({', '.join(margins)}): "
                    f"{self.detail}")
        at = f" at turn {self.turn}" if self.turn is not None else ""
        return f"{self.episode_id}: {self.status}{at}: {self.detail}"

    def outcome(self) -> dict:
        """The result without the episode id: what a cassette records for the episode (`refused_turn`, which
        its detail states too, is left out, so cassettes recorded before it was counted verify alike)."""
        return {k: v for k, v in asdict(self).items() if k not in ("episode_id", "refused_turn")}


@dataclass
class TurnRun:
    """One replayed turn: its prompt, what the engine produced, and (teacher-forced) the trace's own
    turn as token ids."""

    prompt_ids: list[int]
    record: RecordedTurn
    target_ids: list[int] | None = None


@dataclass
class EpisodeRun:
    episode: Episode
    mode: str
    turns: list[TurnRun]
    ending: EpisodeResult | None = None  # why it stopped: a failed turn; free-running also completion or a call


@dataclass(frozen=True)
class PrefillCost:
    """Prompt tokens the engine prefilled, and how many distinct prompt prefixes they hold (what an
    ideal prefix cache shared across turns and episodes would prefill)."""

    prompt_tokens: int
    unique_tokens: int

    @property
    def ratio(self) -> float:
        return self.prompt_tokens / self.unique_tokens if self.unique_tokens else 1.0


class ToolStub:
    """Answers free-running tool calls from a trace: a call gets the recorded answer of a call with the
    same tool name and canonical JSON arguments. Each answer is given once, in recorded order (a
    repeated call takes the next recorded answer), so an episode cannot loop forever."""

    def __init__(self, results: Iterable[ToolResult]) -> None:
        self._answers: dict[tuple[str, str], deque[str]] = defaultdict(deque)
        self._given: dict[tuple[str, str], int] = defaultdict(int)
        for result in results:
            self._answers[(result.name, result.arguments)].append(result.content)

    def answer(self, name: str, arguments: str | dict) -> tuple[str | None, str]:
        """(the recorded answer, "") or (None, why the call is unrecorded)."""
        key = (name, canonical_arguments(arguments))
        if self._answers[key]:
            self._given[key] += 1
            return self._answers[key].popleft(), ""
        used = self._given[key]
        why = f"unrecorded call {name} {key[1]}"
        return None, why + (f": its {used} recorded answer(s) were already used" if used else "")


def replay(llm: LLM, episodes: list[Episode], mode: str, run_seed: int = 0, progress: bool = True) -> list[EpisodeRun]:
    if mode not in MODES:
        raise DeepInferError(f"unknown replay mode {mode!r} (expected one of {', '.join(MODES)})")
    return (teacher_forced if mode == "teacher-forced" else free_running)(llm, episodes, run_seed, progress)


def teacher_forced(llm: LLM, episodes: list[Episode], run_seed: int = 0, progress: bool = True) -> list[EpisodeRun]:
    """Regenerate every assistant turn from its recorded history. A turn whose prompt the engine
    refuses ends its episode there (later turns only have longer prompts). Progress counts turns."""
    runs = [EpisodeRun(e, "teacher-forced", []) for e in episodes]
    jobs: list[tuple[EpisodeRun, int, SuiteRequest, list[int], SamplingParams, list[int] | None]] = []
    for run in runs:
        episode = run.episode
        for turn in range(1, episode.turns + 1):
            request = episode.request(turn)
            try:
                prompt, params = request.prompt_ids(llm), request.params(run_seed, llm)
                llm.check_params(params)  # a constraint that does not compile refuses the turn here
            except DeepInferError as err:
                run.ending = _refused(episode, turn, err)
                break
            jobs.append((run, turn, request, prompt, params, _traced_turn(llm, episode, turn, prompt)))
    with Progress("replay teacher-forced", len(jobs), enabled=progress, unit="turns") as bar:
        outputs = _generate(llm, [(job[3], job[4]) for job in jobs], bar, count_outputs=True)
    for (run, turn, request, prompt, params, target), output in zip(jobs, outputs):
        run.turns.append(TurnRun(prompt, _record(llm, run.episode, turn, request, prompt, params, output)[0], target))
    return runs


def _traced_turn(llm: LLM, episode: Episode, turn: int, prompt: list[int]) -> list[int] | None:
    """The trace's own turn `turn` as token ids: what its encoding holds after the turn's prompt, up to
    and with the end-of-sentence token that closes an assistant turn. None where the encoding of the
    conversation through the turn does not extend the prompt (the encoding changed the history)."""
    protocol = llm.host.protocol()
    conversation = episode.conversation
    try:
        full = protocol.request(conversation.through(turn), conversation.recipe_format).prompt_ids
    except DeepInferError:
        return None
    start = len(prompt)
    if full[:start] != prompt:
        # a turn without reasoning is rendered `</think>answer` where the thinking prompt ends in `<think>`:
        # the model writes it as an empty reasoning, `</think>answer`
        if not (prompt[-1:] == protocol.think_start_id and full[: start - 1] == prompt[:-1]):
            return None
        start -= 1
    rest = full[start:]
    return rest[: rest.index(protocol.eos_id[0]) + 1] if protocol.eos_id[0] in rest else rest


@dataclass
class _Running:
    """A free-running episode between rounds: the conversation so far, as its client's body."""

    run: EpisodeRun
    stub: ToolStub
    users: deque[list[tuple[int, dict]]]
    body: dict
    answered: int = 0  # tool calls the stub answered


def free_running(llm: LLM, episodes: list[Episode], run_seed: int = 0, progress: bool = True) -> list[EpisodeRun]:
    """Progress counts episodes as they end (their number of turns is not known ahead)."""
    states = [_Running(EpisodeRun(e, "free-running", []), ToolStub(e.tool_results),
                       deque(e.conversation.user_blocks()), e.conversation.before(1)) for e in episodes]
    with Progress("replay free-running", len(states), enabled=progress, unit="episodes") as bar:
        while active := [s for s in states if s.run.ending is None]:
            bar.update(len(states) - len(active) - bar.done)  # the episodes that ended since the last round
            jobs = []
            for state in active:
                turn = len(state.run.turns) + 1
                request = state.run.episode.request(turn, state.body)
                try:
                    prompt, params = request.prompt_ids(llm), request.params(run_seed, llm)
                    llm.check_params(params)
                except DeepInferError as err:
                    state.run.ending = _refused(state.run.episode, turn, err)
                    continue
                jobs.append((state, turn, request, prompt, params))
            outputs = _generate(llm, [(job[3], job[4]) for job in jobs], bar, count_outputs=False)
            for (state, turn, request, prompt, params), output in zip(jobs, outputs):
                record, response = _record(llm, state.run.episode, turn, request, prompt, params, output)
                state.run.turns.append(TurnRun(prompt, record))
                _feed_forward(state, turn, response)
        bar.update(len(states) - bar.done)
    return [s.run for s in states]


def _generate(llm: LLM, jobs: list[tuple[list[int], SamplingParams]], bar: Progress,
              count_outputs: bool) -> list[RequestOutput]:
    """`llm.generate` for (prompt ids, params) jobs, outputs in job order, read step by step from the
    engine's stream so that `bar` counts each finished request (with `count_outputs`) and can print a
    status line between steps while a long batch runs."""
    if llm.has_unfinished():
        raise DeepInferError("replay needs an idle engine: finish requests queued with add_request() via step()")
    if llm.layout.world > 1:
        raise DeepInferError(f"replay runs in one process, this launch has {llm.layout.world}: record suites over "
                             "several processes with `deepinfer audit run` or `audit certify`")
    ids = llm.submit([prompt for prompt, _ in jobs], [params for _, params in jobs])
    done: dict[int, RequestOutput] = {}
    for finished in llm.stream():
        done.update((output.request_id, output) for output in finished)
        bar.update(len(finished) if count_outputs else 0)
    return [done[i] for i in ids]


def _feed_forward(state: _Running, turn: int, response: dict) -> None:
    """The next request after the model's turn: the conversation, the model's response as the recipe
    parsed it (in the client's shape), then the stub's answers to its calls or the next user entries.
    Sets `ending` instead when the episode is over."""
    episode = state.run.episode
    conversation = episode.conversation
    calls = response_calls(episode.format, response)
    if calls:
        answers = []
        for call in calls:
            content, why = state.stub.answer(call.name, call.arguments)
            if content is None:
                state.run.ending = EpisodeResult(episode.episode_id, "unrecorded_call", turn, detail=why)
                return
            answers.append(content)
        state.answered += len(calls)
        replies = tool_outputs(episode.format, calls, answers, conversation.custom_tools)
    elif state.users:
        replies = [entry for _, entry in state.users.popleft()]
    else:
        state.run.ending = EpisodeResult(
            episode.episode_id, "completed",
            detail=f"{turn} turn(s) and {state.answered} tool call(s) answered; the trace has {episode.turns} turn(s)")
        return
    history = state.body[CONVERSATION[episode.format]]
    state.body = conversation.with_entries([*history, *response_entries(episode.format, response), *replies])


def _refused(episode: Episode, turn: int, error: DeepInferError) -> EpisodeResult:
    """The episode ends at `turn` because the engine refused its prompt. The detail is the error's kind
    and detail, never the trace file's path: a cassette verified from another folder must agree."""
    return EpisodeResult(episode.episode_id, "error", turn, detail=f"{error.kind}: {error.detail}")


def _record(llm: LLM, episode: Episode, turn: int, request: SuiteRequest, prompt: list[int], params: SamplingParams,
            output: RequestOutput) -> tuple[RecordedTurn, dict]:
    """The turn's outputs, hashed exactly as `harness.record` hashes a run's rows (params without
    defaults), and the response object the recipe parses them into (what the recorded turn keeps of it:
    the entries it adds to the conversation)."""
    fields = generated_fields(params.to_dict(skip_defaults=True), output)
    hashes = stream_hashes(prompt, fields["params"], output.token_ids, output.logprobs, output.finish_reason)
    response = request.request.respond(llm, request.request_id, output)
    record = RecordedTurn(
        turn=turn, prompt_hash=hashes.prompt_hash, token_ids=list(output.token_ids), logprobs=list(output.logprobs),
        top_token_ids=fields["top_token_ids"], top_logprobs=fields["top_logprobs"],
        finish_reason=output.finish_reason, text=output.text, message=recorded_message(episode.format, response),
        token_hash=hashes.token_hash, logit_hash=hashes.logit_hash,
    )
    return record, response


# judging ------------------------------------------------------------------------------------------


def against_trace(run: EpisodeRun, llm: LLM) -> EpisodeResult:
    """The replay judged against the trace: teacher-forced, the first turn whose output differs from
    the trace's own turn (and the turn the engine refused, if one was); free-running, how the episode
    ended."""
    episode_id = run.episode.episode_id
    if run.mode == "free-running":
        assert run.ending is not None, "a free-running replay always ends"
        return run.ending
    for turn in run.turns:
        if turn.target_ids is None:
            return EpisodeResult(episode_id, "error", turn.record.turn, detail="the trace's own turn cannot be cut from "
                                 "its encoding (the conversation through it does not extend the turn's prompt)")
        target = turn.target_ids
        ids = turn.record.token_ids
        position = next((j for j, (a, b) in enumerate(zip(ids, target)) if a != b), None)
        if position is None and len(ids) != len(target):
            position = min(len(ids), len(target))
        if position is None:
            continue
        expected = _token(llm, target, position)
        if position == len(ids) and turn.record.finish_reason == "length":
            detail = f"the output was cut at max_tokens where the trace goes on with {expected}"
        else:
            detail = f"generated {_token(llm, ids, position)} where the trace has {expected}"
        if run.ending is not None:
            detail += f"; turn {run.ending.turn} refused: {run.ending.detail}"
        return EpisodeResult(episode_id, "diverged", turn.record.turn, position,
                             margin=_margin(turn.record, position), detail=detail,
                             refused_turn=run.ending.turn if run.ending is not None else None)
    if run.ending is not None:
        return run.ending
    return EpisodeResult(episode_id, "identical", detail=f"{len(run.turns)} turn(s) regenerated exactly as traced")


def against_recording(run: EpisodeRun, recording: Recording, llm: LLM) -> EpisodeResult:
    """The replay judged against an earlier recording of the same episode: identical, or the first turn
    that differs (its prompt, then its tokens and logprobs, then any other recorded field), or the
    turn at which one of the two stopped while the other went on."""
    episode_id = run.episode.episode_id
    recorded = recording.turns
    for index in range(max(len(run.turns), len(recorded))):
        turn = index + 1
        if index >= len(run.turns):
            ending = run.ending
            if ending is not None and ending.status != "completed":
                return ending
            why = f" ({ending.status}: {ending.detail})" if ending is not None else ""
            return EpisodeResult(episode_id, "diverged", turn,
                                 detail=f"the recording has this turn, the replay stopped before it{why}")
        mine = run.turns[index]
        if index >= len(recorded):
            return EpisodeResult(episode_id, "diverged", turn, detail="the replay went on to this turn, the "
                                 f"recording stopped before it ({recording.outcome.get('detail', '')})")
        theirs = recorded[index]
        if mine.record.prompt_hash != theirs.prompt_hash:
            return EpisodeResult(episode_id, "diverged", turn, detail="its prompt (history, tool results, tools "
                                                                      "or sampling) differs from the recording")
        stream = _stream_divergence(episode_id, turn, mine, theirs, llm)
        if stream is not None:
            return stream
        field = next((f.name for f in fields(RecordedTurn)
                      if getattr(mine.record, f.name) != getattr(theirs, f.name)), None)
        if field is not None:
            return EpisodeResult(episode_id, "diverged", turn, detail=f"the recorded {field} does not match the replay")
    replayed = against_trace(run, llm)
    if replayed.outcome() != recording.outcome:
        return EpisodeResult(episode_id, "diverged", replayed.turn,
                             detail=f"outcome differs: replay {replayed.outcome()}, recorded {recording.outcome}")
    ending = run.ending
    if ending is not None and ending.status == "error":
        return EpisodeResult(episode_id, "identical", detail=f"{len(run.turns)} turn(s) reproduced bit for bit, then "
                                                             f"refused again at turn {ending.turn}: {ending.detail}",
                             refused_turn=ending.turn)
    return EpisodeResult(episode_id, "identical", detail=f"{len(run.turns)} turn(s) reproduced bit for bit")


def _stream_divergence(episode_id: str, turn: int, mine: TurnRun, theirs: RecordedTurn,
                       llm: LLM) -> EpisodeResult | None:
    """Tokens and logprob bits of one turn, compared the way `deepinfer audit compare` compares runs."""
    request_id = turn_request_id(episode_id, turn)
    frames = [pl.DataFrame([_stream_row(request_id, mine.prompt_ids, record)],
                           schema={c: STREAM_SCHEMA[c] for c in _COMPARED_COLUMNS})
              for record in (theirs, mine.record)]
    row = compare_streams(frames[0], frames[1]).row(0, named=True)
    if row["status"] == "equal":
        return None
    if row["status"] == "logprob_drift":
        return EpisodeResult(episode_id, "diverged", turn, detail=f"tokens identical, logprobs differ (max drift "
                                                                  f"{_number(row['max_logprob_drift'])})")
    position = row["first_divergence"]
    return EpisodeResult(
        episode_id, "diverged", turn, position, row["margin_other"], row["margin_ref"], bool(row["near_tie"]),
        detail=f"replay {_token(llm, mine.record.token_ids, position)}, "
               f"recorded {_token(llm, theirs.token_ids, position)}",
    )


def _stream_row(request_id: str, prompt: list[int], record: RecordedTurn) -> dict:
    return {"index": 0, "request_id": request_id, "prompt_token_ids": prompt, "token_ids": record.token_ids,
            "logprobs": record.logprobs, "top_token_ids": record.top_token_ids, "top_logprobs": record.top_logprobs,
            "finish_reason": record.finish_reason, "error_kind": None, "error": None}


def _margin(record: RecordedTurn, position: int) -> float | None:
    if position >= len(record.top_logprobs) or len(record.top_logprobs[position]) < 2:
        return None
    top = record.top_logprobs[position]
    return float(top[0]) - float(top[1])


def _token(llm: LLM, ids: list[int], position: int) -> str:
    if position >= len(ids):
        return "the end of the turn"
    return f"token {ids[position]} {llm.tokenizer.decode([ids[position]])!r}"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def prefill_cost(runs: Iterable[EpisodeRun]) -> PrefillCost:
    """Prompt tokens prefilled by `runs` against distinct prompt prefixes: the size of the prompts'
    prefix trie, counted from the prompts sorted (each adds its length less its common prefix with
    the one before)."""
    prompts = sorted(tuple(turn.prompt_ids) for run in runs for turn in run.turns)
    total = sum(len(p) for p in prompts)
    shared = sum(_common_prefix(a, b) for a, b in zip(prompts, prompts[1:]))
    return PrefillCost(total, total - shared)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
