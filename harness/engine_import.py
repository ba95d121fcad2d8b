"""Other engines' outputs as run folders of the audit store (`deepinfer audit import`).

A file of one output per line (`vllm`: RequestOutput as JSON; `sglang`: /generate responses; `jsonl`:
our plain shape, see audit/FORMAT.md) is matched to a suite's requests by request id (by line order
where a line carries none) and stored as the rows `audit run` would store, so `audit compare`, `audit
diff` and certificates work over it. The manifest names the engine and its settings instead of ours.

Every check runs before anything is written, and the run is written into a hidden sibling folder that
is renamed into place at the end: a refused or interrupted import leaves no run folder behind.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from deepinfer.audit.files import fsync_dir
from deepinfer.audit.manifest import MANIFEST_FORMAT
from deepinfer.audit.store import RunStore, make_row
from deepinfer.errors import DeepInferError
from deepinfer.harness.environment import engine_version
from deepinfer.harness.suite_base import Suite, SuiteRequest
from deepinfer.prompts_file import json_object, read_jsonl_lines

FORMATS = ("vllm", "sglang", "jsonl")
_FINISH_REASONS = ("stop", "length")


@dataclass
class Output:
    """One line of an imported file, in the store's terms; `where` is `file:line`."""

    where: str
    request_id: str | None
    prompt_token_ids: list[int] | None
    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]
    text: str | None
    finish_reason: str
    engine: str | None = None
    engine_version: str | None = None


def check_format(source: str) -> str:
    """`source` if it is a known --from format; DeepInferError otherwise."""
    if source not in FORMATS:
        raise DeepInferError(f"--from {source!r}: unknown format (known: {', '.join(FORMATS)})")
    return source


def import_run(source: str, file: str | Path, suite: Suite, out: str | Path, *, name: str | None = None,
               settings: dict | None = None) -> dict:
    """Convert `file` (in format `source`) of `suite`'s outputs into the new run folder `out`; its root."""
    check_format(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DeepInferError(f"{out}: cannot create a run: it exists and is not an empty folder")
    outputs = read_outputs(source, file)
    rows = _rows(outputs, suite, file)
    engine = {"name": _agreed(outputs, "engine", file) or (source if source != "jsonl" else None),
              "version": _agreed(outputs, "engine_version", file), "settings": dict(settings or {})}
    manifest = {
        "format": MANIFEST_FORMAT,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "engine_version": engine_version(),
        "imported": {"from": source, "file": str(file),
                     "file_hash": hashlib.sha256(Path(file).read_bytes()).hexdigest()},
        "external_engine": engine,
        "suite": suite.describe(),
        "variant": {"name": name or source, "engine": engine["name"], "engine_version": engine["version"],
                    "settings": engine["settings"]},
    }
    return _write(out, manifest, rows)


def _write(out: Path, manifest: dict, rows: list[dict]) -> dict:
    tmp = out.with_name(f".{out.name}.import-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        store = RunStore.create(tmp, manifest)
        store.append(rows)
        root = store.finalize()
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename onto it would also work, but not on every system
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _agreed(outputs: list[Output], key: str, file: str | Path) -> str | None:
    """The `engine` / `engine_version` the lines state (None when none does); lines must agree."""
    values = {getattr(o, key) for o in outputs} - {None}
    if len(values) > 1:
        raise DeepInferError(f"{file}: lines name different values of {key!r}: {sorted(values)}")
    return values.pop() if values else None


def _rows(outputs: list[Output], suite: Suite, file: str | Path) -> list[dict]:
    """The stream rows, in suite order: each output matched to its request and checked against it."""
    positions = {item.request_id: index for index, item in enumerate(suite.requests)}
    matched: dict[int, Output] = {}
    first_at: dict[int, str] = {}
    for position, output in enumerate(outputs):
        if output.request_id is None:
            if position >= len(suite.requests):
                raise DeepInferError(f"{output.where}: no request id, and the suite has only {len(suite.requests)} "
                                     "requests to match it by position")
            index = position
        elif output.request_id in positions:
            index = positions[output.request_id]
        else:
            raise DeepInferError(f"{output.where}: request id {output.request_id!r} is not in the suite {suite.spec}")
        if index in matched:
            raise DeepInferError(f"{output.where}: duplicate request id {suite.requests[index].request_id!r} "
                                 f"(first at {first_at[index]})")
        matched[index], first_at[index] = output, output.where
    missing = [item.request_id for index, item in enumerate(suite.requests) if index not in matched]
    if missing:
        raise DeepInferError(f"{file}: {len(missing)} suite request(s) have no output (first: {missing[0]!r})")
    return [_row(index, suite.requests[index], matched[index]) for index in sorted(matched)]


def _row(index: int, item: SuiteRequest, output: Output) -> dict:
    request = item.request
    suite_prompt = list(request.value) if request is not None and request.source == "prompt_token_ids" else None
    prompt = output.prompt_token_ids
    if prompt is None and suite_prompt is None:
        raise DeepInferError(f"{output.where}: request {item.request_id!r}: the suite's prompt is not token ids "
                             "and the line carries none")
    if prompt is not None and suite_prompt is not None and prompt != suite_prompt:
        raise DeepInferError(f"{output.where}: request {item.request_id!r}: prompt token ids differ from the "
                             f"suite's ({_first_difference(prompt, suite_prompt)})")
    # the params `audit run` records (run seed 0), so a stream equal to ours hashes equal
    params = item.row_params(item.params(0))
    return make_row(index=index, request_id=item.request_id,
                    prompt_token_ids=prompt if suite_prompt is None else suite_prompt, params=params,
                    token_ids=output.token_ids, logprobs=output.logprobs, top_token_ids=output.top_token_ids,
                    top_logprobs=output.top_logprobs, text=output.text, finish_reason=output.finish_reason,
                    error=None, arrival_s=0.0, first_token_s=None, finish_s=0.0)


def _first_difference(found: list[int], wanted: list[int]) -> str:
    for position, (a, b) in enumerate(zip(found, wanted)):
        if a != b:
            return f"first at position {position}: {a} in the file, {b} in the suite"
    return f"{len(found)} tokens in the file, {len(wanted)} in the suite"


def read_outputs(source: str, file: str | Path) -> list[Output]:
    """Every non-blank line of `file` parsed as format `source`; errors name `file:line`."""
    parse = {"vllm": _vllm, "sglang": _sglang, "jsonl": _jsonl}[check_format(source)]
    outputs = []
    for number, line in read_jsonl_lines(file):
        if line.strip():
            where = f"{file}:{number}"
            record = json_object(line, where)
            try:
                output = parse(record, where)
                output.engine = _optional_str(record, "engine")
                output.engine_version = _optional_str(record, "engine_version")
            except _Malformed as err:
                raise DeepInferError(f"{where}: {err}") from None
            outputs.append(output)
    if not outputs:
        raise DeepInferError(f"{file}: no outputs")
    return outputs


class _Malformed(Exception):
    """A problem with one line; read_outputs prefixes its `file:line`."""


def _vllm(record: dict, where: str) -> Output:
    request_id = _optional_str(record, "request_id")
    outputs = _field(record, "outputs", list)
    if len(outputs) != 1 or not isinstance(outputs[0], dict):
        raise _Malformed(f"'outputs' must hold exactly one completion object (n=1), got {len(outputs)}")
    completion = outputs[0]
    tokens = _ints(_field(completion, "token_ids", list), "'outputs[0].token_ids'")
    positions = completion.get("logprobs")
    if positions is None and tokens:
        raise _Malformed(f"request {request_id!r} has no logprobs (run vLLM with logprobs >= 1)")
    positions = _sized(positions or [], tokens, "'outputs[0].logprobs'")
    logprobs, top_ids, top_values = [], [], []
    for position, (token, entries) in enumerate(zip(tokens, positions)):
        if not isinstance(entries, dict):
            raise _Malformed(f"'outputs[0].logprobs[{position}]' must be an object of token id: logprob")
        ranked = []
        for key, entry in entries.items():
            if not isinstance(entry, dict) or not str(key).isdigit():
                raise _Malformed(f"'outputs[0].logprobs[{position}]' must map token ids to {{\"logprob\", \"rank\"}}")
            rank = entry.get("rank")
            ranked.append((rank if isinstance(rank, int) else math.inf, int(key),
                           _fp32(entry.get("logprob"), f"logprob at position {position}")))
        chosen = [value for _, token_id, value in ranked if token_id == token]
        if not chosen:
            raise _Malformed(f"'outputs[0].logprobs[{position}]' lacks the sampled token {token}")
        logprobs.append(chosen[0])
        # the top-k are ranks 1..k; the sampled token's own entry, ranked below them, is not among them
        # (without ranks: every entry, by logprob)
        ranked.sort(key=lambda entry: (entry[0], -entry[2]))
        top = [entry for number, entry in enumerate(ranked) if entry[0] in (number + 1, math.inf)]
        top_ids.append([token_id for _, token_id, _ in top])
        top_values.append([value for _, _, value in top])
    return Output(where, request_id, _optional_ints(record, "prompt_token_ids"), tokens, logprobs, top_ids,
                  top_values, _optional_str(completion, "text"), _finish(completion.get("finish_reason")))


def _sglang(record: dict, where: str) -> Output:
    meta = _field(record, "meta_info", dict)
    request_id = _optional_str(meta, "id")
    tokens = _ints(_field(record, "output_ids", list), "'output_ids'")
    chosen = meta.get("output_token_logprobs")
    if chosen is None and tokens:
        raise _Malformed(f"request {request_id!r} has no logprobs (send return_logprob=true)")
    logprobs = []
    for position, (token, entry) in enumerate(zip(tokens, _sized(chosen or [], tokens, "'output_token_logprobs'"))):
        value, token_id = _triple(entry, f"'output_token_logprobs[{position}]'")
        if token_id != token:
            raise _Malformed(f"'output_token_logprobs[{position}]' is token {token_id}, 'output_ids' has {token}")
        logprobs.append(value)
    top_ids, top_values = [], []
    for position, entries in enumerate(_list(meta.get("output_top_logprobs") or [], "'output_top_logprobs'")):
        what = f"'output_top_logprobs[{position}]'"
        pairs = [_triple(entry, what) for entry in _list(entries or [], what)]
        top_ids.append([token_id for _, token_id in pairs])
        top_values.append([value for value, _ in pairs])
    finish = meta.get("finish_reason")
    return Output(where, request_id, _optional_ints(meta, "input_ids"), tokens, logprobs, top_ids, top_values,
                  _optional_str(record, "text"), _finish(finish.get("type") if isinstance(finish, dict) else finish))


def _jsonl(record: dict, where: str) -> Output:
    request_id = _optional_str(record, "request_id") or _optional_str(record, "id")
    tokens = _ints(_field(record, "token_ids", list), "'token_ids'")
    values = record.get("logprobs")
    if values is None and tokens:
        raise _Malformed(f"request {request_id!r} has no logprobs")
    logprobs = [_fp32(v, f"logprob at position {i}") for i, v in enumerate(_sized(values or [], tokens, "'logprobs'"))]
    top_ids, top_values = [], []
    for position, entries in enumerate(_list(record.get("top_logprobs") or [], "'top_logprobs'")):
        pairs = []
        for entry in _list(entries, f"'top_logprobs[{position}]'"):
            if not (isinstance(entry, list) and len(entry) == 2):
                raise _Malformed(f"'top_logprobs[{position}]' must hold [token_id, logprob] pairs")
            pairs.append((_ints([entry[0]], f"'top_logprobs[{position}]'")[0],
                          _fp32(entry[1], f"top logprob at position {position}")))
        top_ids.append([token_id for token_id, _ in pairs])
        top_values.append([value for _, value in pairs])
    return Output(where, request_id, _optional_ints(record, "prompt_token_ids"), tokens, logprobs, top_ids,
                  top_values, _optional_str(record, "text"), _finish(record.get("finish_reason")))


def _field(record: dict, key: str, kind: type) -> object:
    if not isinstance(record.get(key), kind):
        raise _Malformed(f"{key!r} must be a{'n' if kind is dict else ''} {'object' if kind is dict else 'list'}")
    return record[key]


def _list(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise _Malformed(f"{what} must be a list")
    return value


def _sized(values: object, tokens: list[int], what: str) -> list:
    if not isinstance(values, list) or len(values) != len(tokens):
        raise _Malformed(f"{what} must be a list of one entry per generated token ({len(tokens)})")
    return values


def _ints(values: list, what: str) -> list[int]:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise _Malformed(f"{what} must be a list of token ids (non-negative integers)")
    return list(values)


def _optional_ints(record: dict, key: str) -> list[int] | None:
    return None if record.get(key) is None else _ints(_list(record[key], repr(key)), repr(key))


def _optional_str(record: dict, key: str) -> str | None:
    value = record.get(key)
    if value is not None and not isinstance(value, str):
        raise _Malformed(f"{key!r} must be a string")
    return value


def _triple(entry: object, what: str) -> tuple[float, int]:
    """SGLang's [logprob, token_id, text] as (logprob, token_id)."""
    if not (isinstance(entry, list) and len(entry) in (2, 3)):
        raise _Malformed(f"{what} must hold [logprob, token_id, text] entries")
    return _fp32(entry[0], f"logprob in {what}"), _ints([entry[1]], what)[0]


def _fp32(value: object, what: str) -> float:
    """`value` rounded to binary32, as the store keeps logprobs. Engines compute logprobs in fp32 and
    print them exactly, so this changes nothing for their files; it only makes a rounded print storable."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _Malformed(f"{what} must be a number, got {value!r}")
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        raise _Malformed(f"{what} {value!r} does not fit in fp32") from None


def _finish(reason: object) -> str:
    if reason not in _FINISH_REASONS:
        raise _Malformed(f"finish reason {reason!r} is not one of {', '.join(_FINISH_REASONS)}")
    return reason
