"""Expert, attention data and context parallelism (`deepinfer.parallel`): every layout gives each
request the bits one process gives (ids and logprob bits), on gloo with CPU processes launched by
torchrun, for V4 and V4.1, fp32 and bf16, and after the experts move to an EPLB placement with
copies of the heaviest; the placement policy balances and keeps its promises; a slot's expert output
is the same bits whichever experts share its rank; a suite split over engine replicas (harness
sharding) has the root of one engine."""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import kernels
from deepinfer import LLM, EngineConfig
from deepinfer.checkpoint import preset_config
from deepinfer.checkpoint.files import read_headers, weight_files
from deepinfer.errors import DeepInferError
from deepinfer.parallel import ExpertPlacement, ParallelError, PlacementError, balanced_placement, start_layout
from deepinfer.parallel.context import zigzag_rows
from deepinfer.parallel.placement import held_tensors, rank_loads
from deepinfer.audit.store import read_run
from deepinfer.harness.invariance import signature, standard_requests
from deepinfer.harness.record import record_run
from deepinfer.harness.suite_registry import load_suite
from deepinfer.harness.sweep import Variant

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 12
# tokens each request generates: every layout still runs split prefills, mixed and decode-only steps and
# overflowing exchanges; 24 (the standard set's default) made the 4-rank launch 1.6x as long on 2 cores
MAX_TOKENS = 12


def _launch(processes: int, cases: list[dict], tmp_path: Path) -> dict:
    out = tmp_path / f"results-{processes}.pkl"
    spec = json.dumps({"requests": REQUESTS, "max_tokens": MAX_TOKENS, "cases": cases})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                           str(ROOT / "tests" / "parallel_worker.py"), spec, str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return pickle.loads(out.read_bytes())


@functools.cache
def _reference(preset: str, dtype: str) -> list[tuple]:
    requests = standard_requests(preset_config(preset).vocab_size, count=REQUESTS, max_tokens=MAX_TOKENS)
    llm = LLM(f"preset:{preset}", dtype=dtype)
    return [signature(o) for o in llm.generate([r.prompt for r in requests], [r.params for r in requests])]


LAYOUTS = {
    4: [{"name": "tiny-ep4-dp4", "preset": "tiny", "dtype": "float32", "ep": 4, "dp": 4, "replace": True},
         {"name": "tiny-ep4-dp1", "preset": "tiny", "dtype": "float32", "ep": 4, "dp": 1},
         {"name": "v41-ep4-dp4", "preset": "v41-tiny", "dtype": "bfloat16", "ep": 4, "dp": 4},
         {"name": "tiny-cp4", "preset": "tiny", "dtype": "bfloat16", "ep": 1, "dp": 1, "cp": 4},
         {"name": "v41-cp4-ep4-overflow", "preset": "v41-tiny", "dtype": "float32", "ep": 4, "dp": 1, "cp": 4,
          "engine": {"expert_capacity": 0.5}, "repeat": True}],
    2: [{"name": "tiny-ep2-dp2", "preset": "tiny", "dtype": "bfloat16", "ep": 2, "dp": 2},
         {"name": "tiny-ep1-dp2", "preset": "tiny", "dtype": "float32", "ep": 1, "dp": 2},
         {"name": "tiny-ep2-dp2-capped", "preset": "tiny", "dtype": "bfloat16", "ep": 2, "dp": 2,
          "engine": {"expert_capacity": 4.0}},
         {"name": "v41-ep2-dp1", "preset": "v41-tiny", "dtype": "float32", "ep": 2, "dp": 1, "replace": True},
         {"name": "tiny-cp2", "preset": "tiny", "dtype": "float32", "ep": 1, "dp": 1, "cp": 2},
         {"name": "tiny-cp2-ep2", "preset": "tiny", "dtype": "bfloat16", "ep": 2, "dp": 1, "cp": 2,
          "replace": True},
         {"name": "v41-cp2-dspark-host", "preset": "v41-tiny", "dtype": "bfloat16", "ep": 1, "dp": 1, "cp": 2,
          "engine": {"speculation": "dspark", "engram_tables": "host"}}],
}
CERTIFY_SWEEP = {
    "reference": {"name": "ep2-dp2", "max_num_seqs": 8, "expert_parallel": 2, "data_parallel": 2, "threads": 1},
    "variants": [{"name": "batch-1", "max_num_seqs": 1}, {"name": "dp1", "data_parallel": 1}, {"name": "shards-2", "shards": 2}]}


@pytest.fixture(scope="module")
def launched(v41_checkpoint, tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """One torchrun launch per process count, running every case of that count: LAYOUTS, the quantized
    V4.1 checkpoint (served on 2 processes, only loaded on 4), and on 2 processes `deepinfer audit
    certify` of an 8-request suite over CERTIFY_SWEEP (each launch spends seconds starting its
    processes). The folder holding the certify's suite and output, and each count's results."""
    base = tmp_path_factory.mktemp("parallel")
    suite = base / "suite.jsonl"
    suite.write_text("".join((ROOT / "harness" / "suites" / "smoke.jsonl").read_text().splitlines(True)[:8]))
    (base / "sweep.json").write_text(json.dumps(CERTIFY_SWEEP))
    quantized = {"name": "v41-q", "model": str(v41_checkpoint), "dtype": "float32", "ep": 2, "dp": 2, "replace": True,
                 "engine": {"weight_storage": "quantized"}}
    loaded = {**quantized, "name": "v41-q-ep4", "ep": 4, "dp": 4, "load_only": True}
    certify = {"name": "certify", "cli": ["audit", "certify", "--model", "preset:tiny", "--suite", str(suite), "--sweep",
                                          str(base / "sweep.json"), "--out", str(base / "certified"), "--no-progress"]}
    cases = {4: [*LAYOUTS[4], loaded], 2: [*LAYOUTS[2], quantized, certify]}
    return base, {processes: _launch(processes, each, base) for processes, each in cases.items()}


@pytest.mark.parametrize("processes", list(LAYOUTS))
def test_every_layout_gives_the_bits_of_one_process(launched, processes):
    results = launched[1][processes]
    for case in LAYOUTS[processes]:
        reference = _reference(case["preset"], case["dtype"])
        names = [case["name"]] + ([case["name"] + "-replaced"] if case.get("replace") else []) + (
            [case["name"] + "-again"] if case.get("repeat") else [])
        for name in names:
            diverged = [i for i, (a, b) in enumerate(zip(reference, results[name])) if a != b]
            assert len(results[name]) == REQUESTS and diverged == [], name
        if case.get("replace"):
            before, after = results[case["name"] + "-digests"]
            assert before != after
            counted, slots = results[case["name"] + "-slots"]  # expert loads count tokens, not bucket padding
            assert counted == [slots] * len(counted) and slots > 0
        if case.get("cp"):  # the prefill steps of the standard set (up to 512 tokens) were split
            assert results[case["name"] + "-splits"] > 0


def test_a_fixed_capacity_exchange_reads_nothing_back_and_runs_an_overflowing_step_again(launched):
    """With `expert_capacity` the MoE layers exchange fixed sizes: nothing is read back to the host inside
    them (the sized exchange reads its counts in every layer), and outputs are one process's bits
    (test_every_layout_gives_the_bits_of_one_process) with no slot overflowing (4 times the even share)
    and with many (half of it, V4.1 at CP 4 / EP 4: split steps and whole ones): each step that
    overflowed on any rank ran again on every rank with exact sizes, counted, and a new engine of the
    same settings serving the same set redoes the same number of steps for the same number of slots."""
    two, four = launched[1][2], launched[1][4]
    assert two["tiny-ep2-dp2-reads"] > 0 and two["tiny-ep2-dp2-capped-reads"] == 0
    assert two["tiny-ep2-dp2-capped-redos"] == (0, 0) and two["tiny-ep2-dp2-redos"] == (0, 0)
    redone, slots = four["v41-cp4-ep4-overflow-redos"]
    assert redone > 0 and slots > redone
    assert four["v41-cp4-ep4-overflow-redos-again"] == (redone, slots)


@pytest.mark.parametrize("settings, message", [
    ({"expert_capacity": 2.0}, "expert_capacity sizes the exchange of expert parallelism: set expert_parallel too"),
    ({"expert_capacity": 0, "expert_parallel": 2}, "expert_capacity must be a positive number, got 0"),
    ({"expert_capacity": True, "expert_parallel": 2}, "expert_capacity must be a positive number, got True"),
])
def test_a_bad_expert_capacity_is_refused_in_one_line(settings, message):
    with pytest.raises(DeepInferError) as err:
        EngineConfig(**settings)
    assert str(err.value) == message


def test_quantized_experts_move_between_ranks_as_stored(launched, v41_checkpoint):
    """A V4.1 checkpoint in the release's formats, its experts kept as MXFP4 with E8M0 scales, at
    EP 2 / DP 2 and after an EPLB re-placement moved them between the ranks: one process's bits; and at
    EP 2 and EP 4 each rank reads only its share of the files."""
    results = launched[1][2]
    llm = LLM(v41_checkpoint, weight_storage="quantized")
    requests = standard_requests(llm.config.vocab_size, count=REQUESTS, max_tokens=MAX_TOKENS)
    reference = [signature(o) for o in llm.generate([r.prompt for r in requests], [r.params for r in requests])]
    assert results["v41-q-weights"] == ["QuantizedWeight"]
    assert results["v41-q"] == reference and results["v41-q-replaced"] == reference
    # each rank of EP 2 and of EP 4 read its share of the folder: the tensors every rank holds and its
    # own experts' (the content hash came from the cache), by their offsets in the files
    headers = read_headers(weight_files(v41_checkpoint))
    sizes = {name: math.prod(shape) * getattr(torch, dtype).itemsize for name, (_, dtype, shape) in headers.items()}
    for ranks, read in ((2, results["v41-q-read"]), (4, launched[1][4]["v41-q-ep4-read"])):
        shares = [sum(size for name, size in sizes.items()
                      if held_tensors(llm.config.n_routed_experts, rank, ranks)(name)) for rank in range(ranks)]
        assert read == shares and max(shares) < sum(sizes.values()), ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_gets_the_same_bits_from_a_share_of_the_experts(dtype):
    """What one rank of an expert-parallel layout computes for the slots it receives, weighted and
    combined at the token's rank, is `moe_experts` over every expert, bit for bit."""
    ops = kernels.bind("batch_invariant", "cpu")
    gen = torch.Generator().manual_seed(0)
    experts, top_k, hidden, inter, tokens = 8, 3, 64, 32, 11
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = ops.matmul_layout((torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(dtype))
    w2 = ops.matmul_layout((torch.randn(experts, hidden, inter, generator=gen) / 8).to(dtype))
    indices = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    whole = ops.moe_experts(x, indices, weights, w13, w2, 7.0)
    placement = ExpertPlacement(((5, 0, 3, 5), (1, 2, 4, 6), (7, 6, 2, 0)))  # copies of 0, 2, 5 and 6
    copy = [placement.copies(e)[s % len(placement.copies(e))] for s, e in enumerate(indices.view(-1).tolist())]
    slots = torch.empty(tokens * top_k, hidden, dtype=dtype)
    for rank, held in enumerate(placement.ranks):
        mine = torch.tensor([s for s, (r, _) in enumerate(copy) if r == rank])
        local = torch.tensor([copy[s][1] for s in mine.tolist()])
        stacked = [ops.matmul_layout(torch.stack([w[e] for e in held])) for w in (w13, w2)]
        slots[mine] = ops.expert_outputs(x[mine // top_k], local, *stacked, 7.0)
    assert torch.equal(ops.weighted_combine(slots.view(tokens, top_k, hidden), weights), whole)


def test_placements_cover_every_expert_and_balance_skewed_loads():
    assert ExpertPlacement.contiguous(6, 4).ranks == ((0, 1), (2, 3), (4, 5), (0, 1))
    loads = [100.0, 1, 1, 1, 50, 1, 1, 1, 30, 1, 1, 1, 1, 1, 1, 1]
    contiguous = ExpertPlacement.contiguous(16, 4)
    balanced = balanced_placement(loads, ranks=4, per_rank=5)
    assert [len(balanced.copies(e)) for e in (0, 4, 8, 1)] == [4, 2, 1, 1]  # copies to the most load per copy
    assert max(rank_loads(balanced, loads)) < 0.6 * max(rank_loads(contiguous, loads))
    assert all(len(set(held)) == len(held) for held in balanced.ranks)  # no rank holds two copies of one
    assert balanced_placement(loads, ranks=4, per_rank=5) == balanced  # deterministic
    nodes = balanced_placement(loads, ranks=4, per_rank=4, nodes=2, groups=4)
    for node in (nodes.ranks[:2], nodes.ranks[2:]):  # groups of 4 experts stay within a node
        assert len({e // 4 for held in node for e in held}) == 2


@pytest.mark.parametrize("placement, message", [
    (ExpertPlacement(((0, 1), (2,))), "every rank must hold the same positive number of experts, got [2, 1]"),
    (ExpertPlacement(((0, 1), (1, 1))), "expert 2 is held by no rank"),
    (ExpertPlacement(((0, 1), (2, 9))), "expert 9 is out of range [0, 4)"),
])
def test_a_bad_placement_is_refused_in_one_line(placement, message):
    with pytest.raises(PlacementError) as err:
        placement.check(4)
    assert str(err.value) == message


def test_a_degree_needs_as_many_processes():
    with pytest.raises(DeepInferError) as err:
        LLM("preset:tiny", expert_parallel=2)
    assert str(err.value) == "expert_parallel=2 needs 2 processes (torchrun --nproc-per-node 2); this run has 1"


def test_a_suite_split_over_shards_has_the_root_of_one_engine(tiny_checkpoint, tmp_path):
    """`shards=n` serves the suite's round-robin shares with n engines over the same weights, into one
    run: the same rows, so the same roots, for 1, 2 and 3 shards; stats.json counts every engine. The
    suite is every fourth smoke request (10: text, token-id, chat, tool and structured rows, a 657-token
    prompt), so each of 3 shards gets a mix; the whole smoke set made this test 25 s of the file's 140."""
    lines = (ROOT / "harness" / "suites" / "smoke.jsonl").read_text().splitlines(True)[::4]
    (tmp_path / "suite.jsonl").write_text("".join(lines))
    suite = load_suite(f"native:{tmp_path / 'suite.jsonl'}")
    roots = {}
    for shards in (1, 2, 3):
        variant = Variant.of(f"shards-{shards}", shards=shards, threads=1)
        roots[shards] = record_run(tiny_checkpoint, suite, variant, tmp_path / variant.name, progress=False)
        assert read_run(tmp_path / variant.name).manifest["variant"]["shards"] == shards
    assert roots[1]["count"] == len(suite.requests)
    assert roots[1] == roots[2] == roots[3]
    queried = [json.loads((tmp_path / f"shards-{n}" / "stats.json").read_text())["prefix_query_tokens"] for n in (1, 3)]
    assert queried[0] == queried[1] > 0  # every shard's engine admitted its requests, and was counted


def test_shards_beyond_the_requests_start_no_engine(tiny_checkpoint, tmp_path, monkeypatch):
    """64 shards of a 2-request suite: only the shares that hold a request get an engine (and a cache)."""
    suite = tmp_path / "two.jsonl"
    suite.write_text("".join((ROOT / "harness" / "suites" / "smoke.jsonl").read_text().splitlines(True)[:2]))
    started = []
    with_engine = LLM.with_engine
    monkeypatch.setattr(LLM, "with_engine", lambda self, config: started.append(config) or with_engine(self, config))
    one = record_run(tiny_checkpoint, load_suite(f"native:{suite}"), Variant.of("one", threads=1), tmp_path / "one",
                     progress=False)
    many = record_run(tiny_checkpoint, load_suite(f"native:{suite}"), Variant.of("many", shards=64, threads=1),
                      tmp_path / "many", progress=False)
    assert len(started) == 1 and many == one


def test_a_certification_over_two_processes_has_the_roots_of_one(launched, tmp_path):
    """`torchrun -m deepinfer.harness.cli audit certify` with expert and data parallel configurations:
    rank 0 writes the certificate, every configuration's root is the one a single process records."""
    base, results = launched
    code, printed = results[2]["certify"]
    assert code == 0
    assert "".join(printed).count("verdict: BITWISE_REPRODUCIBLE over all 8 requests") == 1  # rank 0 alone reports
    alone = record_run("preset:tiny", load_suite(str(base / "suite.jsonl")), Variant.of("alone", threads=1),
                       tmp_path / "alone", progress=False)
    for name in ("ep2-dp2", "batch-1", "dp1", "shards-2"):
        run = read_run(base / "certified" / "runs" / name)
        assert run.root == alone
        assert run.manifest["engine"]["parallel"]["world"] == 2


def test_context_parallelism_runs_every_request_on_every_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ParallelError) as err:
        start_layout(expert_parallel=2, data_parallel=2, context_parallel=2, device=torch.device("cpu"))
    assert str(err.value) == "context_parallel runs with data_parallel=1 (every rank runs every request)"


@pytest.mark.parametrize("tokens, ranks", [(256, 2), (1000, 4), (257, 3)])
def test_the_zigzag_split_covers_every_row_once_and_balances_causal_work(tokens, ranks):
    rows = [zigzag_rows(tokens, r, ranks) for r in range(ranks)]
    assert sorted(row for share in rows for row in share) == list(range(tokens))
    work = [sum(row + 1 for row in share) for share in rows]  # a causal query attends to the rows before it
    assert max(work) / min(work) < 1.02


def test_a_rank_generates_only_the_experts_it_holds():
    needed = held_tensors(16, rank=1, ranks=4)  # experts 4..7
    assert [needed(f"model.layers.2.ffn.experts.{e}.w2.weight") for e in (3, 4, 7, 8)] == [False, True, True, False]
    assert needed("layers.0.ffn.experts.5.w1.scale") and not needed("layers.0.ffn.experts.12.w1.scale")
    assert needed("model.layers.2.ffn.gate.weight") and needed("model.layers.2.ffn.shared_experts.w1.weight")
