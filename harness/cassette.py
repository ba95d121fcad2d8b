"""Cassettes: a replay of a trace file recorded by the engine, and its verification.

A cassette is JSONL, editable by hand. Line 1 is the header:

    {"format": "deepinfer-cassette/3", "mode": "teacher-forced" | "free-running", "run_seed": 0,
     "traces": {"path": ..., "content_hash": ...}, "errors": [{"line": N, "message": ...}],
     "prefill": {"prompt_tokens": ..., "unique_tokens": ...}, "manifest": {...},
     "seal": {"algorithm": "sha256", "header": {field: digest}, "entries": [digest, ...]}}

`manifest` is the audit run manifest of the recording engine (checkpoint content hash, engine
configuration, hardware and software, git state); `errors` are the trace file's malformed lines. Each
other line is one episode of the trace file in its client's own format (`Episode.to_json`: a continued
Responses conversation whole), plus `recorded`: per turn the token ids, fp32 logprobs, top-2 logprobs,
finish reason, text, the conversation entries the recipe parsed from them and stream hashes, and the
episode's outcome. Format 3 prompts every turn through DeepSeek's official encoding; earlier formats are
refused in one line that says to record again. Verifying replays every episode from its inputs in the recorded mode
and compares it with `recorded`.

`seal` holds the SHA-256 of each other header field (its canonical JSON) and of each episode line as
written, so verifying names whatever changed after recording: a changed header field refuses the whole
cassette (it says how to replay), a changed, added or missing episode line is reported as `altered` and
the intact episodes still verify. It is a checksum, not a signature: an edit made on purpose is resealed
with `sealed_lines`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer.audit.files import atomic_write
from deepinfer.audit.manifest import describe_protocol
from deepinfer.audit.streams import HEX_DIGEST, canonical_json
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import read_jsonl_lines
from deepinfer.harness.replay import (
    MODES,
    STATUSES,
    EpisodeResult,
    EpisodeRun,
    PrefillCost,
    against_recording,
    against_trace,
    prefill_cost,
    replay,
)
from deepinfer.harness.run_writer import run_manifest
from deepinfer.harness.suite_registry import file_hash
from deepinfer.harness.sweep import Variant, variant_from_dict
from deepinfer.harness.traces import Episode, Recording, TraceError, load_traces, parse_trace_lines

CASSETTE_FORMAT = "deepinfer-cassette/3"
_OLDER_FORMATS = {  # what an earlier format lacks, and why it cannot be verified
    "deepinfer-cassette/1": "is not sealed against changes",
    "deepinfer-cassette/2": "was prompted with the V3-era chat template, not DeepSeek's official encoding",
}
_HEADER_KEYS = {"format", "mode", "run_seed", "traces", "errors", "prefill", "manifest", "seal"}


class AlteredCassette(DeepInferError):
    """The cassette's header, or its seal, changed after recording: nothing in it can be trusted."""


@dataclass
class ReplayReport:
    """Per-episode results (malformed lines included, as `line-N`), what the replay prefilled, and
    how many prompt tokens the engine's prefix cache supplied (None: prefix caching was off)."""

    mode: str
    results: list[EpisodeResult]
    prefill: PrefillCost
    prefix_hit_tokens: int | None = None

    def counts(self) -> dict[str, int]:
        found = Counter(r.status for r in self.results)
        return {status: found[status] for status in STATUSES if found[status]}

    def summary(self) -> str:
        counts = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in self.counts().items())
        cost = self.prefill
        cache = ("prefix caching is off" if self.prefix_hit_tokens is None else
                 f"the prefix cache supplied {self.prefix_hit_tokens} of the "
                 f"{cost.prompt_tokens - cost.unique_tokens} repeated")
        refused = sum(r.refused_turn is not None for r in self.results)
        if refused:  # an identical or diverged episode may still have stopped short of its last turn
            counts += f"; {refused} of them ended where the engine refused a turn's prompt"
        return (f"{len(self.results)} entries ({self.mode}): {counts}\n"
                f"prefill: {cost.prompt_tokens} prompt tokens for {cost.unique_tokens} distinct prefix tokens "
                f"({cost.ratio:.2f}x; {cache})")


@dataclass
class Cassette:
    path: Path
    header: dict
    episodes: list[Episode]
    errors: list[TraceError]  # lines of the cassette itself that do not parse
    altered: list[TraceError]  # episode lines changed, added or missing since recording (line 0: missing)

    @property
    def mode(self) -> str:
        return self.header["mode"]


def record_cassette(llm: LLM, traces: str | Path, out: str | Path, *, mode: str, variant: Variant,
                    run_seed: int = 0, checkpoint_path: str | None = None) -> ReplayReport:
    """Replay every episode of `traces` in `mode` on `llm` (built as `variant` says) and write the
    cassette `out`; results judge each replay against the trace (see `harness.replay.against_trace`)."""
    out = Path(out)
    if out.exists():
        raise DeepInferError(f"{out}: exists (a cassette is never overwritten)")
    episodes, errors = load_traces(traces)
    runs, hits = _replay_counting_hits(llm, episodes, mode, run_seed)
    results = [against_trace(run, llm) for run in runs]
    recorded = [replace(run.episode, recording=Recording([t.record for t in run.turns], result.outcome()))
                for run, result in zip(runs, results)]
    cost = prefill_cost(runs)
    traces_hash = file_hash(Path(traces))
    header = {
        "format": CASSETTE_FORMAT, "mode": mode, "run_seed": run_seed,
        "traces": {"path": str(traces), "content_hash": traces_hash},
        "errors": [{"line": e.line, "message": e.message} for e in errors],
        "prefill": {"prompt_tokens": cost.prompt_tokens, "unique_tokens": cost.unique_tokens},
        "manifest": run_manifest(
            llm, checkpoint_path, suite={"kind": "traces", "path": str(traces), "content_hash": traces_hash,
                                         "count": len(episodes)},
            run_seed=run_seed, variant=variant.to_dict(),
        ),
    }
    lines = sealed_lines(header, [_json_line(e.to_json()).rstrip("\n") for e in recorded])
    atomic_write(out, "".join(line + "\n" for line in lines).encode("utf-8"))
    ordered = sorted([(e.line, r) for e, r in zip(episodes, results)] + [(e.line, _malformed(e)) for e in errors],
                     key=lambda item: item[0])
    return ReplayReport(mode, [r for _, r in ordered], cost, hits)


def _replay_counting_hits(llm: LLM, episodes: list[Episode], mode: str, run_seed: int
                          ) -> tuple[list[EpisodeRun], int | None]:
    """`replay`, and the prompt tokens the prefix cache supplied meanwhile (None when it is off)."""
    before = llm.scheduler.num_prefix_hit_tokens
    runs = replay(llm, episodes, mode, run_seed)
    return runs, None if llm.scheduler.prefix is None else llm.scheduler.num_prefix_hit_tokens - before


def read_cassette(path: str | Path) -> Cassette:
    """The header (which must be intact) and the episodes; a damaged episode line becomes an error."""
    path = Path(path)
    lines = read_jsonl_lines(path)
    header = _header(lines[0][1] if lines else "", path)
    intact, altered = _check_seal(header["seal"], lines[1:], path)
    episodes, errors = parse_trace_lines(str(path), intact)
    return Cassette(path, header, episodes, errors, altered)


def sealed_lines(header: dict, entries: list[str]) -> list[str]:
    """The cassette's lines (without newlines): `header` with the seal over its fields and over
    `entries`, the episode lines as they will be written, then the entries."""
    fields = {key: value for key, value in header.items() if key != "seal"}
    seal = {"algorithm": "sha256", "header": _field_digests(fields), "entries": [_digest(line) for line in entries]}
    return [_json_line({**fields, "seal": seal}).rstrip("\n"), *entries]


def _digest(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def _field_digests(fields: dict) -> dict[str, str]:
    return {key: hashlib.sha256(canonical_json(value)).hexdigest() for key, value in fields.items()}


def _check_seal(seal: dict, lines: list[tuple[int, str]], path: Path
                ) -> tuple[list[tuple[int, str]], list[TraceError]]:
    """The episode lines that are as recorded, and one error per line changed or added since, plus
    one (line 0) when recorded lines are missing from the end."""
    recorded = seal["entries"]
    intact, altered = [], []
    for number, line in lines:
        position = number - 2
        if position < len(recorded) and _digest(line) == recorded[position]:
            intact.append((number, line))
            continue
        problem = ("changed after recording (the seal does not match)" if position < len(recorded) else
                   f"added after recording (the seal has {len(recorded)} episode lines)")
        altered.append(TraceError(number, f"{path}:{number}: {problem}", problem))
    if len(lines) < len(recorded):
        problem = (f"{len(recorded) - len(lines)} of the {len(recorded)} recorded episode line(s) missing "
                   f"after line {len(lines) + 1} (cut off or removed)")
        altered.append(TraceError(0, f"{path}: {problem}", problem))
    return intact, altered


def verify_cassette(llm: LLM, cassette: Cassette) -> ReplayReport:
    """Replay the cassette's episodes on `llm` and compare each with its recording. The trace file's
    malformed lines are listed as `malformed` (there is nothing of theirs to reproduce). A cassette
    `llm` cannot reproduce is refused first (`_check_recorded_with`)."""
    _check_recorded_with(llm, cassette)
    runs, hits = _replay_counting_hits(llm, cassette.episodes, cassette.mode, cassette.header["run_seed"])
    found = [(e.line, _verify_episode(run, llm)) for e, run in zip(cassette.episodes, runs)]
    found += [(e.line, EpisodeResult(f"line-{e.line}", "error", detail=e.message)) for e in cassette.errors]
    found += [(e.line or len(cassette.header["seal"]["entries"]) + 2,
               EpisodeResult(f"line-{e.line}" if e.line else "missing", "altered", detail=e.message))
              for e in cassette.altered]
    malformed = [EpisodeResult(f"line-{e['line']}", "malformed", detail=e["message"])
                 for e in cassette.header["errors"]]
    return ReplayReport(cassette.mode, malformed + [r for _, r in sorted(found, key=lambda item: item[0])],
                        prefill_cost(runs), hits)


def _check_recorded_with(llm: LLM, cassette: Cassette) -> None:
    """Refuse, in one line, a cassette recorded under another prompt encoding (every prompt would be
    rendered otherwise), with another checkpoint, or with another tokenizer (prompt ids would differ).
    A different deepseek-recipe version under the same encoding proceeds: verification compares every
    turn's prompt hash, so a prompt the other version renders otherwise is reported as diverged there.
    A cassette recorded before its manifest held the protocol (or the tokenizer) proceeds too: the
    checkpoint is still checked and every prompt compared turn by turn, and refusing it would leave
    re-recording, which proves nothing about the old recording, as the only way to check it."""
    checkpoint = cassette.header["manifest"]["checkpoint"]
    if "protocol" in checkpoint:
        _check_encoding(llm, cassette.path, checkpoint["protocol"])
    recorded_with = checkpoint["content_hash"]
    if llm.model_id != recorded_with:
        raise DeepInferError(f"{cassette.path}: recorded with checkpoint {recorded_with}, "
                             f"but the engine has {llm.model_id}")
    recorded_tokenizer = (checkpoint.get("tokenizer") or {}).get("content_hash")
    serving_tokenizer = llm.tokenizer.content_hash if llm.tokenizer is not None else None
    if "tokenizer" in checkpoint and recorded_tokenizer != serving_tokenizer:
        raise DeepInferError(f"{cassette.path}: recorded with tokenizer {recorded_tokenizer}, "
                             f"but the engine has {serving_tokenizer}")


def _check_encoding(llm: LLM, path: Path, recorded: object) -> None:
    """The header's `checkpoint.protocol` must name the encoding `llm` renders prompts with."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("encoding"), str):
        raise DeepInferError(f"{path}: the header's manifest.checkpoint.protocol names no encoding")
    serving = llm.host.family.encoding
    if recorded["encoding"] != serving:
        raise DeepInferError(f"{path}: recorded under {describe_protocol(recorded)}, this engine renders prompts "
                             f"with {serving}: replay it with a {recorded['encoding']} checkpoint or record a new "
                             "cassette")


def cassette_engine(cassette: Cassette, model: str | None = None, **overrides: str | None) -> LLM:
    """The engine a cassette was recorded with (its checkpoint path unless `model` is given; the
    max_model_len the recording engine ran with, not a default this machine would resolve), with
    `device`, `dtype` or `numerics` overridden where given, e.g. to check a cassette on other hardware."""
    manifest = cassette.header["manifest"]
    try:
        recorded, max_model_len = manifest["variant"], manifest["engine"]["max_model_len"]
    except (KeyError, TypeError):
        raise DeepInferError(f"{cassette.path}: the header's manifest has no valid variant and engine") from None
    if not isinstance(recorded, dict):
        raise DeepInferError(f"{cassette.path}: the header's manifest has no valid variant and engine")
    changes = {key: value for key, value in overrides.items() if value is not None}
    variant = variant_from_dict({**recorded, **changes, "max_model_len": max_model_len}, f"{cassette.path}: variant")
    model = model if model is not None else manifest["checkpoint"]["path"]
    return LLM(model, replace(variant.engine, seed=cassette.header["run_seed"]))


def _verify_episode(run: EpisodeRun, llm: LLM) -> EpisodeResult:
    recording = run.episode.recording
    if recording is None:
        return EpisodeResult(run.episode.episode_id, "error",
                             detail=f"{run.episode.where}: no recorded outputs to compare with (not a cassette line)")
    return against_recording(run, recording, llm)


def _malformed(error: TraceError) -> EpisodeResult:
    return EpisodeResult(f"line-{error.line}", "malformed", detail=error.message)


def _header(line: str, path: Path) -> dict:
    try:
        header = json.loads(line)
    except json.JSONDecodeError:
        header = None
    if isinstance(header, dict) and header.get("format") in _OLDER_FORMATS:
        raise DeepInferError(f"{path}:1: a {header['format']} cassette {_OLDER_FORMATS[header['format']]}: "
                             "record it again with `deepinfer audit replay record`")
    if not isinstance(header, dict) or header.get("format") != CASSETTE_FORMAT:
        raise DeepInferError(f"{path}:1: not a cassette (the first line must be a {CASSETTE_FORMAT} header)")
    seal = header.get("seal")
    if not (isinstance(seal, dict) and set(seal) == {"algorithm", "header", "entries"}
            and seal["algorithm"] == "sha256" and isinstance(seal["header"], dict)
            and all(isinstance(d, str) and HEX_DIGEST.fullmatch(d) for d in seal["header"].values())
            and isinstance(seal["entries"], list)
            and all(isinstance(d, str) and HEX_DIGEST.fullmatch(d) for d in seal["entries"])):
        raise AlteredCassette(f"{path}:1: seal: missing or malformed (the cassette cannot be checked for changes)")
    digests = _field_digests({key: value for key, value in header.items() if key != "seal"})
    changed = sorted(key for key in set(digests) | set(seal["header"]) if digests.get(key) != seal["header"].get(key))
    if changed:
        raise AlteredCassette(f"{path}:1: header {', '.join(changed)} changed after recording (the seal does not match)")
    if set(header) != _HEADER_KEYS:
        raise DeepInferError(f"{path}:1: header keys must be {', '.join(sorted(_HEADER_KEYS))}")
    if header["mode"] not in MODES:
        raise DeepInferError(f"{path}:1: mode: must be one of {', '.join(MODES)}, got {header['mode']!r}")
    seed = header["run_seed"]
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise DeepInferError(f"{path}:1: run_seed: must be an integer")
    errors = header["errors"]
    if not isinstance(errors, list) or not all(isinstance(e, dict) and set(e) == {"line", "message"} for e in errors):
        raise DeepInferError(f"{path}:1: errors: must be a list of {{'line', 'message'}} objects")
    checkpoint = header["manifest"].get("checkpoint") if isinstance(header["manifest"], dict) else None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("content_hash"), str):
        raise DeepInferError(f"{path}:1: manifest.checkpoint.content_hash: missing")
    return header


def _json_line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False) + "\n"
