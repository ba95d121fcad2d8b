"""Turns a scheduled step into cache addresses, runs the model, and samples the new tokens.

`execute` keeps everything on the device: the step's metadata goes up in one copy, the model,
the sampler, logprobs and top-k run there, and the `RunnerOutput` holds device tensors, whose copy
to the host is queued right behind them. `RunnerOutput.result` waits for that copy (the step's only
sync), which can be after the next step is queued (async scheduling): that step's inputs may hold
placeholders for tokens this one samples, resolved on the device from its outputs (`RunnerOutput.ahead`):
its rows' last kept tokens and, behind a speculative step, their drafts, verified without the host
reading them. A chunk that decodes such a row's last kept token lies that row's kept drafts further on
than the host laid it out: its positions (and its draws' sampling positions, and an Engram lookback)
are moved on the device.
With CUDA graphs on, a decode step's forward (speculation's verify steps too, and with a device
drafter the streams it reads) is replayed from the graph of its shape. Under throughput-aware
verification each step is timed on the device's clock (`StepClock`): its forward and sampling, and
its drafter.

A request with a structured constraint samples only the tokens its constraint allows: the runner
builds each sampled row's mask on the host while the device runs the step's forward, uploads it and
applies it to the logits the sampler draws from (logprobs stay those of the unconstrained logits).

A chunk with draft tokens is sampled at its last token and at each draft (each row with its own
position's noise), and the device counts how many drafts equal the token drawn before them: those
and the token drawn after the last of them are what the chunk yields. With a model drafter
(`deepinfer.engine.draft_runner`), a speculative step then drafts the next tokens of every sampling
chunk on the device, and they come down with the step's results; a plain step runs no drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import time

import numpy as np
import torch

from deepinfer.families.v4.config import ModelConfig
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.draft_runner import DeviceDrafts, DraftInputs
from deepinfer.engine.graph import DraftGraph, StepGraph
from deepinfer.engine.sampler import SamplingBatch, SamplingNeeds, sample, top_logprobs
from deepinfer.engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer.engine.sequence import COLUMN_LIMIT, DRAFTED, DRAWN, ROW_LIMIT, placeholder, placeholder_row
from deepinfer.engine.structured import allowed_tokens, step_masks
from deepinfer.model import NULL_BLOCK, Decoder, StepBatch, bucket
from deepinfer.model.batch import graph_bucket
from deepinfer.transfer import Download, upload


@dataclass
class StepResult:
    """What the host reads of a runner's output (`RunnerOutput.result`), per sampling chunk in
    order: the tokens it drew that count (the sampled token, and after each draft that held the
    token drawn after it), each one's logprob, top logprobs (when asked for) and whether its logits
    were finite; per scoring chunk the prompt logprobs and top logprobs of its `scored` positions;
    with a model drafter, per sampling chunk the tokens it drafted to follow the ones it drew and their
    survivals by its confidence; when the step was timed, the seconds of its forward and sampling and of
    its drafter."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top: list[list[list[tuple[int, float]]] | None]
    finite: list[list[bool]]
    prompt_logprobs: list[list[float]]
    prompt_top: list[list[list[tuple[int, float]]]]
    drafts: list[list[int]] | None = None
    draft_survivals: list[list[float]] | None = None
    forward_seconds: float | None = None
    draft_seconds: float = 0.0


class StepClock:
    """Marks on the device's clock: CUDA events, or on the CPU, whose work is done when its call
    returns, the host's. Read once the step's download is in (its events have completed by then)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Between consecutive marks."""
        pairs = zip(self.marks, self.marks[1:])
        return [a.elapsed_time(b) / 1000 for a, b in pairs] if self.cuda else [b - a for a, b in pairs]


@dataclass
class RunnerOutput:
    """One step's results on the device. Rows [S] follow the sampling chunks in order (then, where the
    drafter takes bucket-shaped inputs, copies of the first up to the bucket: `result` drops them);
    prompt rows [P] follow the scoring chunks' `scored` positions in order.

    token_ids / logprobs [S, 1 + k] (k: the most drafts of a chunk this step): the token drawn after
    the chunk's last token, then after each of its drafts; num_accepted [S]: how many of those
    columns count (1 + the drafts that equal the token drawn before them, counted from the first);
    finite [S, 1 + k]: whether each column's logits were all finite; hidden [R, hidden]: the last
    hidden states of the R sampled rows (each chunk's last token and drafts, in order: a drafter's
    input); top_ids / top_logprobs [S, 1 + k, K]: the K most likely tokens when any row asked for logprobs;
    prompt_logprobs [P] and prompt_top_ids / prompt_top_logprobs [P, Kp] when any chunk scored;
    with a model drafter, drafts [S, B] after each chunk's last kept token, num_drafts [S], how
    many of them the drafter would have verified, and draft_survivals [S, B], the chance by its
    confidence that the drafts up to each hold.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    num_accepted: torch.Tensor
    finite: torch.Tensor
    hidden: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_top_ids: torch.Tensor | None = None
    prompt_top_logprobs: torch.Tensor | None = None
    drafts: torch.Tensor | None = None
    num_drafts: torch.Tensor | None = None
    draft_survivals: torch.Tensor | None = None
    clock: StepClock | None = field(default=None, repr=False)
    download: Download | None = field(default=None, repr=False)

    def ahead(self, drafts: torch.Tensor | None) -> torch.Tensor:
        """[S, 3, C] per output row, what placeholders of this step stand for (`resolved`), by kind: its
        last kept token (LAST), the tokens it drew (DRAWN) and the drafts to follow it (DRAFTED: `drafts`
        [S, B], `ModelRunner.execute` says whose), each kind's columns zero-padded to C."""
        if drafts is None and self.token_ids.shape[1] == 1:  # a plain step's: its one token, as a view
            return self.token_ids.unsqueeze(1).expand(-1, 3, -1)
        last = self.token_ids.gather(1, (self.num_accepted - 1).unsqueeze(1))
        kinds = (last, self.token_ids, self.token_ids[:, :0] if drafts is None else drafts)
        width = max(kind.shape[1] for kind in kinds)
        return torch.stack([torch.nn.functional.pad(kind, (0, width - kind.shape[1])) for kind in kinds], dim=1)

    def send_to_host(self) -> None:
        """Queue the copy of everything but `hidden` to the host (once the step's tensors are all set)."""
        self.download = Download({f.name: getattr(self, f.name) for f in fields(self)
                                  if f.name not in ("hidden", "clock", "download") and getattr(self, f.name) is not None})

    def result(self, scheduled: SchedulerOutput) -> StepResult:
        """What the host needs, sliced per chunk of `scheduled` (this step's): waits for the copy."""
        sampled = len(scheduled.sampling)  # a graphed drafter's step pads its sampling rows to a bucket
        host = {name: tensor.tolist()[:sampled] if name in SAMPLING_ROWS else tensor.tolist()
                for name, tensor in self.download.wait().items()}
        counts = host["num_accepted"]
        top = []
        for row, chunk in enumerate(scheduled.sampling):
            k = chunk.seq.params.logprobs
            top.append([list(zip(ids[:k], values[:k])) for ids, values in
                        zip(host["top_ids"][row][:counts[row]], host["top_logprobs"][row][:counts[row]])]
                       if k else None)
        prompt_logprobs, prompt_top, offset = [], [], 0
        for chunk in scheduled.chunks:
            if not chunk.scored:
                continue
            rows = slice(offset, offset + len(chunk.scored))
            k = max(chunk.seq.params.logprobs or 0, 1)
            prompt_logprobs.append(host["prompt_logprobs"][rows])
            prompt_top.append([list(zip(ids[:k], values[:k])) for ids, values in
                               zip(host["prompt_top_ids"][rows], host["prompt_top_logprobs"][rows])])
            offset += len(chunk.scored)
        def counted(name: str) -> list[list]:
            return [values[:count] for values, count in zip(host[name], counts)]

        drafts = survivals = None
        if "drafts" in host:
            drafts = [values[:count] for values, count in zip(host["drafts"], host["num_drafts"])]
            survivals = [values[:count] for values, count in zip(host["draft_survivals"], host["num_drafts"])]
        result = StepResult(tokens=counted("token_ids"), logprobs=counted("logprobs"), top=top,
                            finite=counted("finite"), prompt_logprobs=prompt_logprobs, prompt_top=prompt_top,
                            drafts=drafts, draft_survivals=survivals)
        if self.clock is not None:
            spans = self.clock.seconds()
            result.forward_seconds, result.draft_seconds = spans[0], sum(spans[1:])
        return result


SAMPLING_ROWS = frozenset({"token_ids", "logprobs", "num_accepted", "finite", "top_ids", "top_logprobs", "drafts",
                           "num_drafts", "draft_survivals"})  # the outputs with a row per sampling chunk


class ModelRunner:
    def __init__(self, model: Decoder, cache: CacheManager, device: torch.device | str,
                 cuda_graphs: bool = False, drafts: DeviceDrafts | None = None, draft_tokens: int = 0,
                 timed: bool = False) -> None:
        self.model = model
        self.drafts, self.draft_tokens = drafts, draft_tokens
        self.timed = timed
        self.ops = model.ops
        self.config: ModelConfig = model.config
        self.cache = cache
        self.device = torch.device(device)
        # decode steps replay graphs captured per step shape (and whether a drafter reads its streams),
        # and a device drafter's pass after one the graph of its own shape, all sharing one memory pool
        # (one replay at a time)
        self.graphs: dict[tuple, StepGraph] | None = None
        self.draft_graphs: dict[tuple, DraftGraph] = {}
        self.compressed_ids: torch.Tensor | None = None  # Engram's compressed id of each token, on the device
        if cuda_graphs and self.device.type == "cuda":
            self.graphs, self.graph_pool = {}, torch.cuda.graph_pool_handle()

    def execute(self, scheduled: SchedulerOutput, in_flight: RunnerOutput | None = None) -> RunnerOutput:
        """Forward the scheduled chunks, sample each sampling chunk's next token and score the
        prompt positions asked for; nothing is read back to the host. `in_flight`: the output of
        the step before, whose sampled tokens this step's placeholders stand for."""
        chunks, sampling = scheduled.chunks, scheduled.sampling
        clock = StepClock(self.device) if self.timed else None
        if clock is not None:
            clock.mark()
        drafting = self.drafts is not None and scheduled.speculative
        # decode steps, and verify steps (a sequence's last token and its drafts), are graphed; a
        # drafter's pass after one takes a row per bucketed sequence and every draft column (graphed or
        # not: the same inputs either way)
        shaped = scheduled.decodes_only
        graphed = self.graphs is not None and shaped
        captures = self._graph_count()
        host_batch, rows = self.build_batch(chunks, graph_bucket if graphed else bucket,
                                            self.draft_tokens if shaped and drafting else None,
                                            in_flight.token_ids.shape[1] - 1 if in_flight is not None else 0)
        rows.update(SamplingBatch.host_tensors([(c.seq.params, c.seq.seed, c.draws_at + j)
                                                for c in sampling for j in range(1 + c.num_draft)]))
        batch, rows = host_batch.to(self.device, rows)  # the step's one upload
        params = SamplingBatch.from_tensors(rows)
        if any(chunk.resolves_input for chunk in chunks):
            if in_flight is None:
                raise RuntimeError("a step takes placeholder tokens as input but no step is in flight")
            verified = self._drafts_ahead(in_flight, rows)
            ahead = in_flight.ahead(None if verified is None else verified.clamp(min=0))
            self._resolve_placeholders(batch, ahead)
            if drafting:
                rows["next_ids"] = resolved(rows["next_ids"], ahead)
            if verified is not None:  # drafts still on the device verify as made, -1 where none was
                rows["drafts"] = resolved(rows["drafts"], in_flight.ahead(verified), first=FIRST_DRAFT)
        if "follows" in rows:
            self._move_on(batch, rows, params, in_flight.num_accepted - 1)
        streams_at: dict[int, torch.Tensor] = {}
        graph = None
        if graphed:
            graph = self._graph(batch, drafting)
            hidden, streams_at = graph.replay(batch), graph.streams_at
        elif drafting:
            hidden = self.model(batch, self.cache.layer_views, streams_at=streams_at)
        else:
            hidden = self.model(batch, self.cache.layer_views)
        sampled_hidden = hidden[rows["sample_rows"]]
        logits = self.model.logits(sampled_hidden)
        logprobs = self.ops.log_softmax(logits)
        needs = SamplingNeeds.of(c.seq.params for c in sampling)
        allowed = self._allowed(sampling, in_flight)  # host work while the device runs the forward
        constrained = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
        drawn = sample(constrained, params, self.ops, needs)
        columns = rows["verify_columns"]  # [S, 1 + k] rows of the R sampled ones
        token_ids = drawn[columns]
        held = (rows["drafts"] == token_ids[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        out = RunnerOutput(
            token_ids=token_ids,
            logprobs=logprobs.gather(1, drawn.unsqueeze(1)).squeeze(1)[columns],
            num_accepted=held + 1,
            finite=torch.isfinite(logits).all(dim=-1)[columns],
            hidden=sampled_hidden,
        )
        k = max((c.seq.params.logprobs or 0 for c in sampling), default=0)
        if k:
            top_ids, top_values = top_logprobs(logprobs, k)
            out.top_ids, out.top_logprobs = top_ids[columns], top_values[columns]
        scoring = [c for c in chunks if c.scored]
        if scoring:
            prompt = self.ops.log_softmax(self.model.logits(hidden[rows["score_rows"]]))
            out.prompt_logprobs = prompt.gather(1, rows["score_targets"].unsqueeze(1)).squeeze(1)
            kp = max(max(c.seq.params.logprobs or 0, 1) for c in scoring)
            out.prompt_top_ids, out.prompt_top_logprobs = top_logprobs(prompt, kp)
        if clock is not None:
            clock.mark()
        if drafting:
            next_ids = rows["next_ids"].index_put((batch.sample_index[rows["sample_rows"]],), drawn)
            inputs = DraftInputs(batch if graph is None else graph.batch, streams_at, next_ids, rows["sample_chunks"],
                                 rows["draws_at"], token_ids, out.num_accepted, params.rows(columns[:, 0]), needs)
            drafted = self.drafts.run(inputs) if graph is None else self._draft_graph(graph, inputs).replay(inputs)
            if drafted is not None:
                out.drafts, out.num_drafts, out.draft_survivals = drafted
            if clock is not None:
                clock.mark()
        # a step that captured a graph took the capture's time too, many replays' worth: it times nothing
        out.clock = clock if self._graph_count() == captures else None
        out.send_to_host()
        return out

    def _graph_count(self) -> int:
        return len(self.graphs or {}) + len(self.draft_graphs)

    def _allowed(self, sampling: list[ScheduledChunk], in_flight: RunnerOutput | None) -> torch.Tensor | None:
        """bool [R, vocab]: the tokens each sampled row's structured constraint allows (None when no
        chunk has one), from masks built on the host (`structured.step_masks`) and uploaded. A chunk
        whose last token is still a placeholder reads it from the step in flight: the constraint is
        taken past it to build the mask, and back (`Scheduler.update` advances it for good)."""
        if not any(chunk.seq.grammar is not None for chunk in sampling):
            return None
        flight = None
        rows = []
        for chunk in sampling:
            pending = []
            if chunk.seq.grammar is not None and chunk.resolves_input:
                flight = flight if flight is not None else in_flight.download.wait()
                row = placeholder_row(chunk.seq.token_ids[chunk.draws_at - 1])
                pending = [int(flight["token_ids"][row, flight["num_accepted"][row] - 1])]
            rows.append((chunk.seq.grammar, pending, chunk.draft_ids))
        masks = upload({"masks": step_masks(rows, self.config.vocab_size)}, self.device)["masks"]
        return allowed_tokens(masks, self.config.vocab_size)

    def _resolve_placeholders(self, batch: StepBatch, ahead: torch.Tensor) -> None:
        """Put the tokens of the step in flight (`ahead`: `RunnerOutput.ahead`) in place of their
        placeholders in `batch`'s input ids (and, for Engram, in its compressed ids and lookback,
        through the compressed map)."""
        batch.input_ids = resolved(batch.input_ids, ahead)
        if batch.engram_ids is not None:
            if self.compressed_ids is None:
                self.compressed_ids = self.model.engram_tokens.compressed.to(self.device)
            batch.engram_ids = resolved(batch.engram_ids, ahead, self.compressed_ids)
            batch.engram_lookback = resolved(batch.engram_lookback, ahead, self.compressed_ids)

    @staticmethod
    def _drafts_ahead(in_flight: RunnerOutput, rows: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """[S, B] per row of the step in flight, the drafts this step's draft placeholders stand for, -1
        where there is none to verify: its device drafter's, up to the number it would verify, or a host
        drafter's candidates (`rows["candidates"]` [C, W], for the rows `rows["candidate_rows"]` [C]) past
        the tokens the row kept, where the candidates before them predicted those. None when it has none."""
        if "candidates" in rows:
            candidates, follows = rows["candidates"], rows["candidate_rows"]
            kept, drawn = in_flight.num_accepted[follows], in_flight.token_ids[follows]
            width = candidates.shape[1]
            columns = torch.arange(drawn.shape[1], device=drawn.device)
            predicted = candidates.gather(1, columns.clamp(max=width - 1).expand_as(drawn))
            predicted = torch.where(columns < width, predicted, -1)
            held = ((predicted == drawn) | (columns >= kept.unsqueeze(1))).all(dim=1)
            index = kept.unsqueeze(1) + torch.arange(width, device=drawn.device)
            picked = candidates.gather(1, index.clamp(max=width - 1))
            picked = torch.where(held.unsqueeze(1) & (index < width), picked, -1)
            drafts = torch.full((in_flight.token_ids.shape[0], width), -1, dtype=torch.long, device=drawn.device)
            return drafts.index_copy(0, follows, picked)
        if in_flight.drafts is None:
            return None
        drafts = in_flight.drafts
        made = torch.arange(drafts.shape[1], device=drafts.device) < in_flight.num_drafts.unsqueeze(1)
        return torch.where(made, drafts, -1)

    def _move_on(self, batch: StepBatch, rows: dict[str, torch.Tensor], params: SamplingBatch,
                 kept: torch.Tensor) -> None:
        """Move each chunk that decodes an in-flight row's last kept token (`rows["follows"]`, per token
        and per sequence row) on by the drafts that row kept (`kept` [S]): its positions, its draws'
        sampling positions and first index, and its Engram lookback, which the host laid out with the
        row's drawn tokens after the known ones (`build_batch`)."""
        def moved(follows: torch.Tensor) -> torch.Tensor:
            return torch.where(follows >= 0, kept[follows.clamp(min=0)], 0)

        follows, chunk_follows = rows["follows"], rows["chunk_follows"]
        batch.positions = batch.positions + moved(follows)
        params.position = params.position + moved(follows[batch.sample_index[rows["sample_rows"]]])
        rows["draws_at"] = rows["draws_at"] + moved(chunk_follows[rows["sample_chunks"]])
        if batch.engram_lookback is not None:
            extra = batch.engram_lookback.shape[1] - self.model.engram_tokens.lookback
            start = torch.where(chunk_follows >= 0, moved(chunk_follows), extra)
            columns = start.unsqueeze(1) + torch.arange(self.model.engram_tokens.lookback, device=start.device)
            batch.engram_lookback = batch.engram_lookback.gather(1, columns)

    def _graph(self, batch: StepBatch, tap_streams: bool) -> StepGraph:
        """The graph of a decode step's forward shaped like `batch` (captured on first sight), with
        `tap_streams` one that also hands out the streams a device drafter reads."""
        key = (tuple(sorted(batch.shapes().items())), tap_streams)
        if key not in self.graphs:
            self.graphs[key] = StepGraph(self.model, self.cache.layer_views, batch, self.graph_pool, tap_streams)
        return self.graphs[key]

    def _draft_graph(self, forward: StepGraph, step: DraftInputs) -> DraftGraph:
        """The graph of the drafter's pass after `forward`'s steps, for inputs shaped like `step`."""
        key = (id(forward), step.token_ids.shape, step.needs)
        if key not in self.draft_graphs:
            self.draft_graphs[key] = DraftGraph(self.drafts, step, self.graph_pool)
        return self.draft_graphs[key]

    def build_batch(self, chunks: list[ScheduledChunk], table_bucket: Callable[[int], int] = bucket,
                    draft_columns: int | None = None, drawn_ahead: int = 0) -> tuple[StepBatch, dict[str, torch.Tensor]]:
        """The step's model input on the host, padded to its buckets (`deepinfer.model.batch`; block
        tables to `table_bucket` of the longest, `graph_bucket` for graphed steps), and
        the rows of the model's output that each sampling chunk samples from (`sample_rows`) and each
        scored position scores (`score_rows`, with the prompt token it scores in `score_targets`).
        The model returns, per chunk, its scored positions' rows, then its sampled rows (its last
        token's and each draft's). `verify_columns` [S, 1 + k] lays the sampled rows out per sampling
        chunk (a chunk with fewer drafts repeats its first row) and `drafts` [S, k] holds the drafts
        (-1, which no token equals, past a chunk's own); `sample_chunks` [S] and `draws_at` [S] give
        each sampling chunk's row in the batch and the index of the first token it draws; `next_ids`
        [T] the token after each of the step's tokens where the host knows it (-1 at sampled rows, 0
        for padding, placeholders resolved on the device like the input ids; a model drafter's input,
        made only for one). With `draft_columns`, the sampling rows are padded to one per bucketed
        sequence row and to that many draft columns (padding repeats the first sampling chunk, with no
        drafts), so that a graphed drafter's inputs have the step bucket's shapes. `drawn_ahead`: the
        drafts each row of the step in flight may have kept (0 for a plain one); when some may have,
        `follows` [T] and `chunk_follows` [B] name per token and per sequence row the in-flight row
        whose last kept token the chunk decodes (-1 elsewhere), which `execute` moves them on by, and an
        Engram lookback is that many columns wider: such a chunk's history ends with the in-flight row's
        drawn tokens as placeholders, every other's with that many more known tokens."""
        num_tokens = sum(chunk.num_tokens for chunk in chunks)
        ids, positions, query_start = [], [], []
        sample_index, sample_rows, score_rows, score_targets = [], [], [], []
        width = max([chunk.num_draft for chunk in chunks] + [draft_columns or 0])
        verify_columns, drafts, sample_chunks, draws_at, next_ids = [], [], [], [], []
        chunk_follows = [-1 if chunk.follows is None else chunk.follows for chunk in chunks] if drawn_ahead else []
        follows = []
        for index, chunk in enumerate(chunks):  # Python lists, one tensor each at the end: a step has hundreds
            seq = chunk.seq
            if chunk_follows:
                follows.extend([chunk_follows[index]] * chunk.num_tokens)
            query_start.append(len(ids))
            score_rows.extend(range(len(sample_index), len(sample_index) + len(chunk.scored)))
            score_targets.extend(seq.prompt_token_ids[chunk.scored.start + 1:chunk.scored.stop + 1])
            sample_index.extend(len(ids) + p - chunk.start for p in chunk.scored)
            ids.extend(chunk.input_ids)
            positions.extend(range(chunk.start, chunk.end))
            if self.drafts is not None:
                known = seq.token_ids[chunk.start + 1:chunk.draws_at if chunk.samples else chunk.end + 1]
                next_ids.extend(known + [-1] * (chunk.num_tokens - len(known)))
            if chunk.samples:
                first = len(sample_rows)
                for row in range(len(ids) - 1 - chunk.num_draft, len(ids)):
                    sample_rows.append(len(sample_index))
                    sample_index.append(row)
                verify_columns.append([first + j if j <= chunk.num_draft else first for j in range(width + 1)])
                drafts.append(chunk.draft_ids + [-1] * (width - chunk.num_draft))
                sample_chunks.append(index)
                draws_at.append(chunk.draws_at)
        seq_rows = bucket(len(chunks))
        if draft_columns is not None and sample_chunks:
            extra = seq_rows - len(sample_chunks)
            verify_columns += [[0] * (width + 1)] * extra
            drafts += [[-1] * width] * extra
            sample_chunks += [sample_chunks[0]] * extra
            draws_at += [draws_at[0]] * extra
        padding = [0] * (bucket(num_tokens) - num_tokens)
        query_start += [num_tokens] * (seq_rows + 1 - len(chunks))
        padded_index = sample_index + [0] * (bucket(len(sample_index)) - len(sample_index))
        batch = StepBatch(
            input_ids=torch.tensor(ids + padding, dtype=torch.long),
            positions=torch.tensor(positions + padding, dtype=torch.long),
            query_start=torch.tensor(query_start, dtype=torch.long),
            block_tables={pool: self._block_table(chunks, pool, seq_rows, table_bucket) for pool in self.cache.specs},
            block_size=self.cache.block_size, sample_index=torch.tensor(padded_index, dtype=torch.long),
        )
        engram = self.model.engram_tokens
        if engram is not None:
            reach = engram.lookback + (drawn_ahead if chunk_follows else 0)
            histories = [chunk.seq.token_ids[max(chunk.start - reach, 0):chunk.start] for chunk in chunks]
            for history, row in zip(histories, chunk_follows):
                if row >= 0:
                    history.extend(placeholder(row, DRAWN, j) for j in range(drawn_ahead))
            batch.engram_ids, batch.engram_lookback = engram.step_inputs(batch.input_ids, histories, seq_rows, reach)
            if self.model.engram_on_host:
                batch.engram_memory = self.model.engram_memory(batch)
        rows = {name: torch.tensor(values, dtype=torch.long) for name, values in
                (("sample_rows", sample_rows), ("score_rows", score_rows), ("score_targets", score_targets),
                 ("sample_chunks", sample_chunks), ("draws_at", draws_at))}
        if self.drafts is not None:
            rows["next_ids"] = torch.tensor(next_ids + padding, dtype=torch.long)
        looked_up = [chunk for chunk in chunks if chunk.candidates is not None]
        if looked_up:
            longest = max(len(chunk.candidates) for chunk in looked_up)
            rows["candidates"] = torch.tensor([chunk.candidates + [-1] * (longest - len(chunk.candidates))
                                               for chunk in looked_up], dtype=torch.long)
            rows["candidate_rows"] = torch.tensor([chunk.follows for chunk in looked_up], dtype=torch.long)
        if chunk_follows:
            rows["follows"] = torch.tensor(follows + [-1] * len(padding), dtype=torch.long)
            rows["chunk_follows"] = torch.tensor(chunk_follows + [-1] * (seq_rows - len(chunks)), dtype=torch.long)
        rows["verify_columns"] = torch.tensor(verify_columns, dtype=torch.long).reshape(len(drafts), width + 1)
        rows["drafts"] = torch.tensor(drafts, dtype=torch.long).reshape(len(drafts), width)
        return batch, rows

    @staticmethod
    def _block_table(chunks: list[ScheduledChunk], pool: str, rows: int, table_bucket: Callable[[int], int]
                     ) -> torch.Tensor:
        """[rows, M] physical blocks of each chunk's sequence in `pool` (M: `table_bucket` of the longest
        table), the null block where a sequence has none."""
        tables = [chunk.seq.blocks.table(pool) for chunk in chunks]
        width = table_bucket(max(map(len, tables), default=1))
        out = np.full((rows, width), NULL_BLOCK, dtype=np.int64)  # row by row: long tables convert 3x faster
        for row, table in enumerate(tables):
            out[row, :len(table)] = table
        return torch.from_numpy(out)


FIRST_DRAFT = placeholder(0, DRAFTED)  # every draft placeholder is at most this


def resolved(ids: torch.Tensor, ahead: torch.Tensor, table: torch.Tensor | None = None, first: int = -1
             ) -> torch.Tensor:
    """`ids` with each placeholder (`deepinfer.engine.sequence.placeholder`) at most `first` replaced
    by the token it names in `ahead` (`RunnerOutput.ahead`), mapped through `table` when given; on the
    device, no sync."""
    index = (-1 - ids).clamp(min=0)
    rest = index // ROW_LIMIT
    rows, kinds, columns = index % ROW_LIMIT, rest // COLUMN_LIMIT, rest % COLUMN_LIMIT
    tokens = ahead[rows, kinds, columns]
    if table is not None:
        tokens = table[tokens]
    return torch.where(ids <= first, tokens, ids)
