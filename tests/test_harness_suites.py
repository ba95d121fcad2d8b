"""Suites and sweeps: what a certification runs, checked before anything runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from deepinfer.audit.store import read_run
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.harness.record import record_run
from deepinfer.harness.suite_registry import KINDS, TOP_LOGPROBS, Suite, SuiteKind, load_suite, register_kind, request_seed
from deepinfer.harness.sweep import FACTORS, Variant, check_variant, checkpoint_drafter, default_sweep, load_sweep
from import_graph import import_graph


def write_lines(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_shipped_smoke_suite_meets_the_certify_brief(tiny_checkpoint) -> None:
    suite = load_suite("smoke")
    assert suite.kind == "native" and len(suite.requests) >= 32
    llm = LLM(tiny_checkpoint, max_model_len=2048)  # the official tools block alone is ~600 tiny-BPE tokens
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
    kinds = {next(k for k in ("regex", "json_schema", "choice", "grammar") if k in p.structured)
             for p in params if p.structured is not None}
    assert kinds == {"regex", "json_schema", "choice", "grammar"}


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
    assert sweep.reference.engine.max_num_seqs == 32
    assert {variants["batch-1"].engine.max_num_seqs, variants["batch-8"].engine.max_num_seqs} == {1, 8}
    assert variants["shuffled"].shuffle and variants["staggered"].stagger
    assert variants["chunk-16"].engine.max_num_batched_tokens == 16 and variants["preemption"].engine.num_cache_blocks
    assert not variants["chunk-off"].engine.enable_chunked_prefill and variants["batch-3"].engine.max_num_seqs == 3
    assert [v.name for v in sweep.variants][:len(FACTORS)] == [name for name, _ in FACTORS]  # the matrix's list too
    assert variants["threads-1"].threads == 1 and sweep.reference.threads is None
    assert sweep.reference.engine.async_scheduling and not variants["sync-steps"].engine.async_scheduling
    assert sweep.reference.engine.speculation == "off" and variants["speculation"].engine.speculation == "ngram"
    assert [c.engine.numerics for c in sweep.controls] == ["fast"]
    assert all(v.engine.numerics == "batch_invariant" for v in (sweep.reference, *sweep.variants))
    assert not any(name.startswith("draft-") for name in variants)  # only for a checkpoint with a draft model:
    for model, drafter in (("preset:tiny", "mtp"), ("preset:v41-tiny", "dspark")):
        own = [v.engine for v in default_sweep(drafter=checkpoint_drafter(model)).variants if v.name.startswith("draft-")]
        assert [(e.speculation, e.draft_tokens, e.draft_confidence) for e in own] == [
            (drafter, 1, 0.0), (drafter, 3, 0.0), (drafter, 5, 0.0), (drafter, 5, 0.05)]
    on_cuda = {v.name: v for v in default_sweep(device="cuda").variants}
    assert "threads-1" not in on_cuda and "threads-1" in variants  # GPU kernels: no CPU threads
    assert not on_cuda["graphs-off"].engine.cuda_graphs and "graphs-off" not in variants


def test_a_run_uses_its_variants_thread_count_and_restores_the_process_one(tiny_checkpoint, tmp_path) -> None:
    suite = load_suite(write_lines(tmp_path / "s.jsonl", [{"id": "a", "prompt_token_ids": [3, 4, 5], "sampling": {"max_tokens": 2}}]))
    before = torch.get_num_threads()
    record_run(tiny_checkpoint, suite, Variant.of("one", threads=1), tmp_path / "run", progress=False)
    assert torch.get_num_threads() == before
    assert read_run(tmp_path / "run").manifest["environment"]["torch_cpu"]["threads"] == 1


def test_sweep_file_inherits_from_the_reference(tmp_path) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"reference": {"name": "ref", "max_num_seqs": 4, "dtype": "bfloat16"},
                                "variants": [{"name": "one", "max_num_seqs": 1}],
                                "controls": [{"name": "fast", "numerics": "fast"}]}))
    sweep = load_sweep(path)
    assert sweep.variants[0] == sweep.reference.derive("one", max_num_seqs=1)
    assert sweep.controls[0].engine.dtype == "bfloat16" and sweep.controls[0].engine.max_num_seqs == 4
    assert sweep.to_dict()["variants"][0] == {**sweep.reference.to_dict(), "name": "one", "max_num_seqs": 1}
    assert [role for role, _ in sweep.configurations()] == ["reference", "variant", "control"]


@pytest.mark.parametrize("name", ["", "../up", ".hidden", "a b", "x/y"])
def test_configuration_names_must_be_safe_folder_names(name) -> None:
    with pytest.raises(DeepInferError, match="'name' must be a non-empty string of letters"):
        check_variant(Variant.of(name), "flags")


def test_a_variant_leaves_the_budget_and_length_to_the_engine() -> None:
    # the engine itself raises the budget to max_model_len without chunking (tests/test_defaults.py)
    off = Variant.of("b", max_num_batched_tokens=32, enable_chunked_prefill=False).engine
    assert off.max_num_batched_tokens == 32 and not off.enable_chunked_prefill
    assert off.max_model_len is None


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "x", "seed": 3}, "sweep.json: variants[0]: unknown field(s) ['seed']"),
    ({"name": "x", "dtype": "int8"}, "sweep.json: variants[0]: unknown dtype 'int8' (expected one of float32, fp32, "
                                     "bfloat16, bf16, float16, fp16)"),
    ({"name": "x", "max_num_seqs": 0}, "sweep.json: variants[0]: max_num_seqs must be a positive integer, got 0"),
    ({"name": "x", "max_num_seqs": "8"}, "sweep.json: variants[0]: 'max_num_seqs' must be int, got '8'"),
    ({"name": "x", "device": "tpu"}, "sweep.json: variants[0]: unknown device 'tpu' (expected cpu, cuda or cuda:N)"),
    ({"name": "x", "draft_confidence": "high"}, "sweep.json: variants[0]: 'draft_confidence' must be float, got 'high'"),
    ({"name": "x", "draft_confidence": 2}, "sweep.json: variants[0]: draft_confidence must be a number from 0 to 1, "
                                           "got 2"),
])
def test_bad_engine_settings_in_a_sweep_file_are_one_line_errors(tmp_path, monkeypatch, entry, message) -> None:
    monkeypatch.chdir(tmp_path)
    Path("sweep.json").write_text(json.dumps({"reference": {"name": "ref"}, "variants": [entry]}))
    with pytest.raises(DeepInferError, match=f"^{re.escape(message)}$"):
        load_sweep("sweep.json")


# the registry of suite kinds and the import graph ---------------------------------------------------

def test_suite_kinds_never_import_the_registry() -> None:
    """The registry imports the kinds; a kind importing it back would be a cycle (tests/test_imports.py
    checks the whole tree) and would make `import deepinfer.harness.traces` alone load every kind."""
    graph = import_graph()
    for kind in ("suite_base", "traces", "lm_eval_suite"):
        assert "deepinfer.harness.suite_registry" not in graph[f"deepinfer.harness.{kind}"], kind


IMPORT_ORDERS = [("deepinfer.harness.traces", "deepinfer.harness.suite_registry"), ("deepinfer.harness.suite_registry", "deepinfer.harness.traces"),
                 ("deepinfer.harness.suite_base", "deepinfer.harness.replay", "deepinfer.harness.cassette")]


@pytest.fixture(scope="module")
def imported() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Each of IMPORT_ORDERS imported in a fresh interpreter, then harness.suites, which prints its kinds
    (two interpreters at a time: each spends ~1 s importing torch)."""
    def run(order: tuple[str, ...]) -> subprocess.CompletedProcess:
        code = f"import {', '.join(order)}, deepinfer.harness.suite_registry; print(list(deepinfer.harness.suite_registry.KINDS))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(IMPORT_ORDERS, pool.map(run, IMPORT_ORDERS)))


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_harness_modules_import_in_any_order(imported, order) -> None:
    result = imported[order]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['native', 'traces', 'lm-eval']"


def test_a_registered_kind_loads_its_specs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("deepinfer.harness.suite_registry.KINDS", dict(KINDS))
    loaded = []

    def load_words(target: str) -> Suite:
        loaded.append(target)
        return Suite("words", tmp_path, "0" * 64, [], target=target)

    register_kind(SuiteKind("words", load_words, reads_file=False))
    assert load_suite("words:a,b").spec == "words:a,b" and loaded == ["a,b"]
    with pytest.raises(ValueError, match="suite kind 'traces' is already registered"):
        register_kind(SuiteKind("traces", load_words))
    with pytest.raises(DeepInferError, match=r"\(known: native, traces, lm-eval, words\)$"):
        load_suite("foo:bar")


def test_a_checkpoint_folder_says_whether_it_stores_its_draft_model(tiny_checkpoint, tmp_path) -> None:
    """A folder is asked for its `mtp.*` tensors (headers only): without them the sweep has no draft-model
    variant rather than one that would fail."""
    from checkpoint_edits import copy_with

    stripped = tmp_path / "stripped"
    copy_with(tiny_checkpoint, stripped, lambda t: [t.pop(n) for n in [n for n in t if n.startswith("mtp.")]])
    assert checkpoint_drafter(tiny_checkpoint) in ("dspark", "mtp")
    assert checkpoint_drafter(stripped) is None
