"""Stream hashes and run Merkle roots ("deepinfer-stream/1"); the byte format is in FORMAT.md.

Two digests per request: `token_hash` commits to the prompt, params, generated ids and finish reason;
`logit_hash` also commits to the IEEE-754 bits of every logprob, so a run that reproduces tokens but
not numerics is told apart from one that reproduces both.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import polars as pl

from deepinfer.audit.errors import AuditError

STREAM_FORMAT = "deepinfer-stream/1"
RUN_FORMAT = "deepinfer-run/1"
EMPTY_ROOT_PREIMAGE = b"deepinfer-merkle/1 empty"

STREAM_SCHEMA: dict[str, pl.DataType] = {
    "index": pl.Int64(),
    "request_id": pl.String(),
    "prompt_token_ids": pl.List(pl.Int64()),
    "params": pl.String(),
    "prompt_hash": pl.String(),
    "token_ids": pl.List(pl.Int64()),
    "logprobs": pl.List(pl.Float32()),
    "top_token_ids": pl.List(pl.List(pl.Int64())),
    "top_logprobs": pl.List(pl.List(pl.Float32())),
    "text": pl.String(),
    "finish_reason": pl.String(),
    "error_kind": pl.String(),
    "error": pl.String(),
    "token_hash": pl.String(),
    "logit_hash": pl.String(),
    "arrival_s": pl.Float64(),
    "first_token_s": pl.Float64(),
    "finish_s": pl.Float64(),
}

HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
ERROR_KIND = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class StreamHashes:
    """Lower-case hex SHA-256 digests of one request's stream."""

    prompt_hash: str
    token_hash: str
    logit_hash: str


def canonical_json(obj: object) -> bytes:
    """The one JSON encoding that is hashed or compared: sorted keys, no spaces, ASCII, no NaN."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise AuditError(f"cannot encode as canonical JSON: {exc}") from None
    return text.encode("utf-8")


def _u32(value: object, what: str) -> bytes:
    try:
        number = operator.index(value)
    except TypeError:
        raise AuditError(f"{what} {value!r} is not an integer") from None
    if not 0 <= number <= 0xFFFFFFFF:
        raise AuditError(f"{what} {number} does not fit in u32")
    return struct.pack("<I", number)


def fp32_bits(value: object, what: str = "logprob") -> int:
    """The IEEE-754 binary32 bits of `value`, which must already be an fp32 number.

    A float64 that is not exactly an fp32 would be rounded silently when stored in a Float32 column,
    and the stored row would then no longer match its hash; such values are rejected instead.
    """
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise AuditError(f"{what} {value!r} is not a number") from None
    if math.isnan(number):
        raise AuditError(f"{what} is NaN")
    not_fp32 = AuditError(f"{what} {number!r} is not an fp32 value")
    try:
        packed = struct.pack("<f", number)
    except OverflowError:
        raise not_fp32 from None
    if struct.unpack("<f", packed)[0] != number:
        raise not_fp32
    return struct.unpack("<I", packed)[0]


def stream_header(prompt_token_ids: Sequence[int], params: dict) -> bytes:
    """The bytes whose SHA-256 is the prompt_hash and the start of both chains."""
    if not isinstance(params, dict):
        raise AuditError(f"params must be a dict, got {type(params).__name__}")
    prompt = list(prompt_token_ids)
    encoded_params = canonical_json(params)
    return b"".join([
        STREAM_FORMAT.encode("ascii") + b"\n",
        _u32(len(prompt), "prompt length"),
        *(_u32(token, "prompt token id") for token in prompt),
        _u32(len(encoded_params), "params length"),
        encoded_params,
    ])


def _chains(header: bytes, token_ids: list, logprobs: list, reason: bytes) -> StreamHashes:
    start = hashlib.sha256(header).digest()
    token_state = logit_state = start
    for position, (token, logprob) in enumerate(zip(token_ids, logprobs)):
        token_bytes = _u32(token, f"token id at position {position}")
        token_state = hashlib.sha256(token_state + b"T" + token_bytes).digest()
        bits = struct.pack("<I", fp32_bits(logprob, f"logprob {position}"))
        logit_state = hashlib.sha256(logit_state + b"L" + token_bytes + bits).digest()
    end = b"E" + _u32(len(token_ids), "token count") + _u32(len(reason), "finish reason length") + reason
    return StreamHashes(
        prompt_hash=start.hex(),
        token_hash=hashlib.sha256(token_state + end).hexdigest(),
        logit_hash=hashlib.sha256(logit_state + end).hexdigest(),
    )


def stream_hashes(prompt_token_ids: Sequence[int], params: dict, token_ids: Sequence[int],
                  logprobs: Sequence[float], finish_reason: str) -> StreamHashes:
    """Hashes of a served request: one logprob (an fp32 value, not NaN) per generated id."""
    tokens, values = list(token_ids), list(logprobs)
    if len(tokens) != len(values):
        raise AuditError(f"{len(tokens)} token ids but {len(values)} logprobs")
    if not isinstance(finish_reason, str):
        raise AuditError(f"finish_reason must be a string, got {finish_reason!r}")
    return _chains(stream_header(prompt_token_ids, params), tokens, values, finish_reason.encode("utf-8"))


def error_hashes(prompt_token_ids: Sequence[int], params: dict, kind: str, detail: str) -> StreamHashes:
    """Hashes of a request that could not be served: no tokens, the reason is "error:KIND: DETAIL".

    `kind` classifies the error (lower-case letters, digits and '_'); `detail` says what was wrong
    without naming where the input came from, so the same failure hashes the same from any folder."""
    if not isinstance(kind, str) or not ERROR_KIND.fullmatch(kind):
        raise AuditError(f"error kind must be lower-case letters, digits and '_', got {kind!r}")
    if not isinstance(detail, str):
        raise AuditError(f"error detail must be a string, got {detail!r}")
    reason = b"error:" + kind.encode("ascii") + b": " + detail.encode("utf-8")
    return _chains(stream_header(prompt_token_ids, params), [], [], reason)


def merkle_root(request_ids: Sequence[str], digests: Sequence[str]) -> str:
    """Hex Merkle root over (request id, digest) leaves given in index order."""
    if len(request_ids) != len(digests):
        raise AuditError(f"{len(request_ids)} request ids but {len(digests)} digests")
    level = []
    for request_id, digest in zip(request_ids, digests):
        if not isinstance(digest, str) or not HEX_DIGEST.fullmatch(digest):
            raise AuditError(f"digest {digest!r} of request {request_id!r} is not 64 lower-case hex digits")
        name = request_id.encode("utf-8")
        level.append(hashlib.sha256(b"\x00" + _u32(len(name), "request id length") + name
                                    + bytes.fromhex(digest)).digest())
    if not level:
        return hashlib.sha256(EMPTY_ROOT_PREIMAGE).hexdigest()
    while len(level) > 1:
        paired = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        level = paired + level[len(level) - len(level) % 2:]
    return level[0].hex()


def run_root(streams: pl.DataFrame) -> dict:
    """The root.json content of a run, from the stored hash columns (rows are taken in index order)."""
    ordered = streams.sort("index", maintain_order=True)
    if ordered["index"].is_duplicated().any():
        raise AuditError("streams have duplicate index values")
    request_ids = ordered["request_id"].to_list()
    return {
        "format": RUN_FORMAT,
        "count": ordered.height,
        "token_root": merkle_root(request_ids, ordered["token_hash"].to_list()),
        "logit_root": merkle_root(request_ids, ordered["logit_hash"].to_list()),
    }
