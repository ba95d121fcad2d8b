"""Tests for audit.streams: stream hashes and the run Merkle root ("deepinfer-stream/1").

tests/golden/audit_vectors.json pins the hashes; every vector is checked twice, against audit.streams
and against the from-scratch reference below (written from audit/FORMAT.md with hashlib/struct only),
so a bug in audit.streams cannot hide in vectors it generated itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import polars as pl
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deepinfer.audit.errors import AuditError
from deepinfer.audit.streams import (
    STREAM_SCHEMA,
    StreamHashes,
    canonical_json,
    error_hashes,
    merkle_root,
    run_root,
    stream_hashes,
    stream_header,
)

VECTORS = json.loads((Path(__file__).parent / "golden" / "audit_vectors.json").read_text(encoding="utf-8"))


# --- independent reference implementation (do not share code with audit.streams) ---

def ref_header(prompt: list[int], params: dict) -> bytes:
    p = json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    counted_prompt = struct.pack(f"<{len(prompt) + 1}I", len(prompt), *prompt)
    return b"deepinfer-stream/1\n" + counted_prompt + struct.pack("<I", len(p)) + p


def ref_hashes(prompt: list[int], params: dict, tokens: list[int], bits: list[int], reason: bytes) -> tuple:
    h0 = hashlib.sha256(ref_header(prompt, params)).digest()
    t = l = h0
    for token, b in zip(tokens, bits):
        t = hashlib.sha256(t + b"T" + struct.pack("<I", token)).digest()
        l = hashlib.sha256(l + b"L" + struct.pack("<II", token, b)).digest()
    tail = b"E" + struct.pack("<II", len(tokens), len(reason)) + reason
    return h0.hex(), hashlib.sha256(t + tail).hexdigest(), hashlib.sha256(l + tail).hexdigest()


def ref_merkle(ids: list[str], digests: list[str]) -> str:
    nodes = []
    for rid, d in zip(ids, digests):
        raw = rid.encode()
        nodes.append(hashlib.sha256(b"\x00" + struct.pack("<I", len(raw)) + raw + bytes.fromhex(d)).digest())
    if not nodes:
        return hashlib.sha256(b"deepinfer-merkle/1 empty").hexdigest()
    while len(nodes) > 1:
        nodes = [hashlib.sha256(b"\x01" + nodes[i] + nodes[i + 1]).digest() if i + 1 < len(nodes) else nodes[i]
                 for i in range(0, len(nodes), 2)]
    return nodes[0].hex()


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bits_of(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# --- vectors ---

@pytest.mark.parametrize("vector", VECTORS["streams"], ids=[v["name"] for v in VECTORS["streams"]])
def test_stream_vectors(vector):
    prompt, params, tokens = vector["prompt_token_ids"], vector["params"], vector["token_ids"]
    bits = [int(b, 16) for b in vector["logprob_bits"]]
    expected = StreamHashes(vector["prompt_hash"], vector["token_hash"], vector["logit_hash"])
    assert stream_header(prompt, params).hex() == vector["header_hex"] == ref_header(prompt, params).hex()
    if vector["error"] is None:
        reason = vector["finish_reason"].encode()
        got = stream_hashes(prompt, params, tokens, [f32(b) for b in bits], vector["finish_reason"])
    else:
        assert vector["finish_reason"] == "error" and not tokens
        reason = b"error:" + vector["error_kind"].encode() + b": " + vector["error"].encode()
        got = error_hashes(prompt, params, vector["error_kind"], vector["error"])
    assert got == expected
    assert ref_hashes(prompt, params, tokens, bits, reason) == (expected.prompt_hash, expected.token_hash,
                                                                expected.logit_hash)


def test_vectors_cover_the_edge_cases():
    streams = VECTORS["streams"]
    all_bits = [int(b, 16) for v in streams for b in v["logprob_bits"]]
    assert any(not v["token_ids"] and v["error"] is None for v in streams)  # empty output
    assert any(len(v["token_ids"]) == 1 for v in streams)
    assert any(len(v["token_ids"]) >= 3 for v in streams)
    assert 0x80000000 in all_bits  # -0.0
    assert any(b & 0x7F800000 == 0 and b & 0x007FFFFF for b in all_bits)  # subnormal
    assert any(b & 0x7F800000 == 0x7F000000 for b in all_bits)  # largest finite exponent
    assert any(not v["finish_reason"].isascii() for v in streams)
    assert any(v["error"] is not None and not v["error"].isascii() for v in streams)
    assert {len(m["request_ids"]) for m in VECTORS["merkle"]} >= {0, 1, 2, 3, 5}


@pytest.mark.parametrize("vector", VECTORS["merkle"], ids=[str(len(m["request_ids"])) for m in VECTORS["merkle"]])
def test_merkle_vectors(vector):
    ids, digests = vector["request_ids"], vector["digests"]
    assert merkle_root(ids, digests) == vector["root"] == ref_merkle(ids, digests)


# --- properties ---

token_ids = st.integers(0, 2**32 - 1)
fp32_values = st.floats(width=32, allow_nan=False)
params_dicts = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(-10, 10**12), st.floats(allow_nan=False,
                               allow_infinity=False), st.text(max_size=5), st.booleans(), st.none()), max_size=4)


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(token_ids, max_size=6), params=params_dicts,
       stream=st.lists(st.tuples(token_ids, fp32_values), max_size=8), reason=st.text(max_size=6))
def test_stream_hashes_match_reference(prompt, params, stream, reason):
    tokens = [t for t, _ in stream]
    logprobs = [x for _, x in stream]
    got = stream_hashes(prompt, params, tokens, logprobs, reason)
    want = ref_hashes(prompt, params, tokens, [bits_of(x) for x in logprobs], reason.encode())
    assert (got.prompt_hash, got.token_hash, got.logit_hash) == want


@settings(max_examples=40, deadline=None)
@given(leaves=st.lists(st.tuples(st.text(max_size=4), st.binary(min_size=32, max_size=32)), max_size=9))
def test_merkle_root_matches_reference(leaves):
    ids = [rid for rid, _ in leaves]
    digests = [d.hex() for _, d in leaves]
    assert merkle_root(ids, digests) == ref_merkle(ids, digests)


@settings(max_examples=60, deadline=None)
@given(stream=st.lists(st.tuples(token_ids, fp32_values), min_size=1, max_size=6), data=st.data())
def test_one_logprob_bit_changes_logit_hash_only(stream, data):
    tokens = [t for t, _ in stream]
    logprobs = [x for _, x in stream]
    position = data.draw(st.integers(0, len(stream) - 1))
    bit = data.draw(st.integers(0, 31))
    flipped = f32(bits_of(logprobs[position]) ^ (1 << bit))
    assume(not math.isnan(flipped))
    changed = logprobs[:position] + [flipped] + logprobs[position + 1:]
    before = stream_hashes([1, 2], {"seed": 0}, tokens, logprobs, "stop")
    after = stream_hashes([1, 2], {"seed": 0}, tokens, changed, "stop")
    assert after.token_hash == before.token_hash and after.prompt_hash == before.prompt_hash
    assert after.logit_hash != before.logit_hash


def test_each_input_changes_the_hashes():
    base = stream_hashes([1, 2], {"seed": 0}, [3, 4], [-0.5, -1.0], "stop")
    variants = [
        stream_hashes([1, 2, 0], {"seed": 0}, [3, 4], [-0.5, -1.0], "stop"),
        stream_hashes([1, 2], {"seed": 1}, [3, 4], [-0.5, -1.0], "stop"),
        stream_hashes([1, 2], {"seed": 0}, [3, 5], [-0.5, -1.0], "stop"),
        stream_hashes([1, 2], {"seed": 0}, [3, 4], [-0.5, -1.0], "length"),
        stream_hashes([1, 2], {"seed": 0}, [3], [-0.5], "stop"),
    ]
    for variant in variants:
        assert variant.token_hash != base.token_hash and variant.logit_hash != base.logit_hash
    assert error_hashes([1, 2], {"seed": 0}, "malformed", "boom") != error_hashes([1, 2], {"seed": 0}, "malformed",
                                                                                "boom!")
    assert error_hashes([1, 2], {"seed": 0}, "malformed", "boom") != error_hashes([1, 2], {"seed": 0},
                                                                                "prompt_too_long", "boom")


def test_canonical_json():
    assert canonical_json({"b": [1, 2.5], "a": "é"}) == b'{"a":"\\u00e9","b":[1,2.5]}'
    with pytest.raises(AuditError, match="^cannot encode as canonical JSON: Out of range float values"):
        canonical_json({"t": float("nan")})


@pytest.mark.parametrize(("call", "message"), [
    (lambda: stream_hashes([1], {}, [2, 3], [-1.0, float("nan")], "stop"), "logprob 1 is NaN"),
    (lambda: stream_hashes([1], {}, [2], [0.1], "stop"), "logprob 0 0.1 is not an fp32 value"),
    (lambda: stream_hashes([1], {}, [2], [1e39], "stop"), "logprob 0 1e+39 is not an fp32 value"),
    (lambda: stream_hashes([1], {}, [2**32], [-1.0], "stop"), "token id at position 0 4294967296 does not fit in u32"),
    (lambda: stream_hashes([-1], {}, [], [], "stop"), "prompt token id -1 does not fit in u32"),
    (lambda: stream_hashes([1], {}, [2, 3], [-1.0], "stop"), "2 token ids but 1 logprobs"),
    (lambda: stream_hashes([1], [], [], [], "stop"), "params must be a dict, got list"),
    (lambda: merkle_root(["a"], ["AB" * 32]),
     "digest '" + "AB" * 32 + "' of request 'a' is not 64 lower-case hex digits"),
    (lambda: merkle_root(["a", "b"], ["00" * 32]), "2 request ids but 1 digests"),
])
def test_bad_input_is_rejected(call, message):
    with pytest.raises(AuditError) as info:
        call()
    assert str(info.value) == message


def test_run_root_uses_index_order_and_rejects_duplicate_indices():
    ids = ["a", "b", "c"]
    digests = [hashlib.sha256(x.encode()).hexdigest() for x in ids]
    frame = pl.DataFrame({"index": [2, 0, 1], "request_id": ["c", "a", "b"],
                          "token_hash": [digests[2], digests[0], digests[1]],
                          "logit_hash": [digests[2], digests[0], digests[1]]})
    root = merkle_root(ids, digests)
    assert run_root(frame) == {"format": "deepinfer-run/1", "count": 3, "token_root": root, "logit_root": root}
    with pytest.raises(AuditError, match="^streams have duplicate index values$"):
        run_root(frame.with_columns(pl.Series("index", [0, 0, 1])))


def test_stream_schema_is_the_documented_one():
    assert list(STREAM_SCHEMA) == [
        "index", "request_id", "prompt_token_ids", "params", "prompt_hash", "token_ids", "logprobs",
        "top_token_ids", "top_logprobs", "text", "finish_reason", "error_kind", "error", "token_hash",
        "logit_hash", "arrival_s", "first_token_s", "finish_s"]
    assert STREAM_SCHEMA["logprobs"] == pl.List(pl.Float32)
    assert STREAM_SCHEMA["top_logprobs"] == pl.List(pl.List(pl.Float32))
