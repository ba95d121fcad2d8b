"""Suites and sweeps: what a certification runs, checked before anything runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from audit.store import read_run
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from harness.record import record_run
from harness.suites import TOP_LOGPROBS, load_suite, request_seed
from harness.sweep import Variant, check_variant, default_sweep, load_sweep


def write_lines(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_shipped_smoke_suite_meets_the_certify_brief(tiny_checkpoint) -> None:
    suite = load_suite("smoke")
    assert suite.kind == "native" and len(suite.requests) >= 32
    llm = LLM(tiny_checkpoint, max_model_len=1024)
    lengths = [len(r.prompt_ids(llm)) for r in suite.requests]
    assert min(lengths) < 8 and max(lengths) > 500  # short prompts and ones past several compress windows
    sources = [r.request.source for r in suite.requests]
    assert {"prompt", "prompt_token_ids", "messages"} <= set(sources)
    chats = [r.request for r in suite.requests if r.request.source == "messages"]
    assert any(r.tools for r in chats)
    assert any(m.get("tool_calls") for r in chats for m in r.value)
    assert any(m["role"] == "tool" for r in chats for m in r.value)
    params = [r.params(0) for r in suite.requests]
    assert any(p.temperature == 0 for p in params) and any(p.temperature > 0 for p in params)


def test_params_always_carry_a_seed_and_top2_logprobs(tmp_path) -> None:
    path = write_lines(tmp_path / "s.jsonl", [
        {"id": "a", "prompt_token_ids": [5, 6], "sampling": {"temperature": 0.8}},
        {"id": "b", "prompt_token_ids": [5, 6], "sampling": {"seed": 7, "logprobs": 5}},
    ])
    a, b = load_suite(path).requests
    assert a.params(3).seed == request_seed(3, "a") != a.params(4).seed
    assert a.params(3).logprobs == TOP_LOGPROBS
    assert (b.params(3).seed, b.params(3).logprobs) == (7, 5)


def test_derived_seeds_depend_on_the_request_id_not_its_position(tmp_path) -> None:
    forward = write_lines(tmp_path / "f.jsonl", [{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"}])
    backward = write_lines(tmp_path / "b.jsonl", [{"id": "y", "prompt": "b"}, {"id": "x", "prompt": "a"}])
    seeds = lambda path: {r.request_id: r.params(0).seed for r in load_suite(path).requests}  # noqa: E731
    assert seeds(forward) == seeds(backward)


def test_suite_spec_forms(tmp_path) -> None:
    path = write_lines(tmp_path / "s.jsonl", [{"prompt": "hi"}, "", {"prompt": "there"}])
    plain, prefixed = load_suite(path), load_suite(f"native:{path}")
    assert plain.content_hash == prefixed.content_hash and plain.spec == prefixed.spec
    assert [r.request_id for r in plain.requests] == ["line-1", "line-3"]
    unknown_kind = r"^unknown suite kind 'foo' in 'foo:bar' \(known: native, traces, lm-eval\)$"
    with pytest.raises(DeepInferError, match=unknown_kind):
        load_suite("foo:bar")
    with pytest.raises(DeepInferError, match=r"^suite 'nope.jsonl': no such file$"):
        load_suite("nope.jsonl")


@pytest.mark.parametrize(("rows", "message"), [
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], r":2: duplicate id 'a' \(first at .*:1\)$"),
    ([{"prompt": "x", "extra": 1}], r":1: unknown field\(s\) \['extra'\]$"),
    ([{"prompt": "x", "id": 3}], r":1: 'id' must be a non-empty string$"),
    ([{"prompt": "x", "tools": []}], r":1: 'tools' only goes with 'messages'$"),
    ([{"messages": "hi"}], r":1: 'messages' must be a list of message objects$"),
])
def test_bad_suite_lines_name_the_line(tmp_path, rows, message) -> None:
    with pytest.raises(DeepInferError, match=message):
        load_suite(write_lines(tmp_path / "s.jsonl", rows))


def test_default_sweep_covers_the_contract() -> None:
    sweep = default_sweep()
    variants = {v.name: v for v in sweep.variants}
    assert sweep.reference.max_num_seqs == 32
    assert {variants["batch-1"].max_num_seqs, variants["batch-8"].max_num_seqs} == {1, 8}
    assert variants["shuffled"].shuffle and variants["staggered"].stagger
    assert variants["chunk-32"].max_num_batched_tokens == 32 and variants["preemption"].num_cache_blocks
    assert variants["threads-1"].threads == 1 and sweep.reference.threads is None
    assert [c.numerics for c in sweep.controls] == ["fast"]
    assert all(v.numerics == "batch_invariant" for v in (sweep.reference, *sweep.variants))
    assert "threads-1" not in {v.name for v in default_sweep(device="cuda").variants}  # GPU kernels: no CPU threads


def test_a_run_uses_its_variants_thread_count_and_restores_the_process_one(tiny_checkpoint, tmp_path) -> None:
    suite = load_suite(write_lines(tmp_path / "s.jsonl", [{"id": "a", "prompt_token_ids": [3, 4, 5], "sampling": {"max_tokens": 2}}]))
    before = torch.get_num_threads()
    record_run(tiny_checkpoint, suite, Variant("one", threads=1), tmp_path / "run", progress=False)
    assert torch.get_num_threads() == before
    assert read_run(tmp_path / "run").manifest["environment"]["torch_cpu"]["threads"] == 1


def test_sweep_file_inherits_from_the_reference(tmp_path) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"reference": {"name": "ref", "max_num_seqs": 4, "dtype": "bfloat16"},
                                "variants": [{"name": "one", "max_num_seqs": 1}],
                                "controls": [{"name": "fast", "numerics": "fast"}]}))
    sweep = load_sweep(path)
    assert sweep.variants[0] == replace(sweep.reference, name="one", max_num_seqs=1)
    assert sweep.controls[0].dtype == "bfloat16" and sweep.controls[0].max_num_seqs == 4
    assert [role for role, _ in sweep.configurations()] == ["reference", "variant", "control"]


@pytest.mark.parametrize("name", ["", "../up", ".hidden", "a b", "x/y"])
def test_configuration_names_must_be_safe_folder_names(name) -> None:
    with pytest.raises(DeepInferError, match="'name' must be a non-empty string of letters"):
        check_variant(Variant(name), "flags")


def test_variant_engine_kwargs_leave_the_budget_and_length_to_the_engine() -> None:
    # the engine itself raises the budget to max_model_len without chunking (tests/test_defaults.py)
    off = Variant("b", max_num_batched_tokens=32, enable_chunked_prefill=False).engine_kwargs()
    assert off["max_num_batched_tokens"] == 32 and not off["enable_chunked_prefill"]
    assert off["max_model_len"] is None
