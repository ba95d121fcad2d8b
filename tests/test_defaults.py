"""One source of engine defaults. max_model_len comes from the model (its max_position_embeddings,
capped so the default cache fits in memory) on every path: `LLM`, `deepinfer generate`, `audit run`,
`audit replay record` and sweep files, and runs record the resolved value. max_num_seqs and
max_num_batched_tokens have one default everywhere. Unseeded requests derive their seed from the
request order (default) or, on request, from their content."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer import kernels
from deepinfer.audit.store import read_run
from deepinfer import LLM, SamplingParams
from deepinfer import cli as engine_cli
from deepinfer.checkpoint import preset_config
from deepinfer.engine.cache import CACHE_MEMORY_FRACTION, cache_bytes, cache_memory, default_max_model_len
from deepinfer.engine.config import EngineConfig, config_from_flags
from deepinfer.errors import DeepInferError
from deepinfer.families.v4.model import DeepseekV4
from deepinfer.sampling_params import CONTENT_SEEDS, derive_seed, request_content_hash
from deepinfer.harness.cassette import cassette_engine, read_cassette
from deepinfer.harness.cli import add_audit, main
from deepinfer.harness.record import record_run
from deepinfer.harness.suite_registry import SHIPPED, load_suite
from deepinfer.harness.sweep import Variant, default_sweep, load_sweep

TINY_POSITIONS = 4096  # the tiny preset's max_position_embeddings: its default cache fits any machine
LONG = 3000  # prompt tokens: refused when the harness defaulted to max_model_len=1024
GREEDY = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
CONTENT_DIGEST = "354e405572de4dd9a4daa1c717cb05ba4599d60699e7ab9f04f258c3ec02530b"
CONTENT_SEED = 1823625532096907750


def long_prompt() -> list[int]:
    return [2 + (7 * i) % 1000 for i in range(LONG)]


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def parse(*argv: str):
    return engine_cli.build_parser((add_audit,)).parse_args(list(argv))


# the cap rule -----------------------------------------------------------------------------------


def specs_of(preset: str) -> tuple[list, int, int]:
    """The cache pools of a preset (built on the meta device: no weights), its positions, its itemsize."""
    config = preset_config(preset)
    dtype = torch.bfloat16 if config.extra["dtype"] == "bfloat16" else torch.float32
    specs = DeepseekV4(config, kernels.bind("batch_invariant", "cpu"), dtype, device="meta").pools
    return specs, config.max_position_embeddings, dtype.itemsize


def sizing(chunked: bool = True) -> dict:
    defaults = EngineConfig()
    return dict(max_num_seqs=defaults.max_num_seqs, max_num_batched_tokens=defaults.max_num_batched_tokens,
                chunked_prefill=chunked, block_size=defaults.block_size)


@pytest.mark.parametrize("preset", ["tiny", "small", "flash-4l"])
@pytest.mark.parametrize("chunked", [True, False])
def test_the_default_is_the_models_length_or_the_largest_block_multiple_that_fits(preset, chunked):
    specs, positions, itemsize = specs_of(preset)
    kwargs = dict(sizing(chunked), itemsize=itemsize)

    def bytes_at(length: int) -> int:
        return cache_bytes(specs, max_model_len=length, **kwargs)

    assert default_max_model_len(specs, positions, bytes_at(positions), **kwargs) == positions
    for budget in (bytes_at(positions) - 1, bytes_at(positions // 3) + 5, bytes_at(16)):
        got = default_max_model_len(specs, positions, budget, **kwargs)
        assert got % 16 == 0 and 16 <= got < positions
        assert bytes_at(got) <= budget < bytes_at(got + 16)
    with pytest.raises(DeepInferError, match="^the cache for max_num_seqs=32 sequences of even 16 tokens does not "
                                             "fit in the 1 bytes set aside for it"):
        default_max_model_len(specs, positions, 1, **kwargs)


def test_flash_4l_keeps_its_million_positions_in_half_an_h200_after_the_weights():
    specs, positions, itemsize = specs_of("flash-4l")
    half_of_what_is_left = int((139 - 51) * 2**30 * CACHE_MEMORY_FRACTION)  # 51 GiB of bf16 weights
    assert default_max_model_len(specs, positions, half_of_what_is_left, **sizing(), itemsize=itemsize) == 1048576
    # without chunked prefill a step may hold a whole prompt, so the window pool grows with the length too
    capped = default_max_model_len(specs, positions, half_of_what_is_left, **sizing(False), itemsize=itemsize)
    assert 16384 < capped < positions


def test_memory_for_the_cache_is_half_of_what_the_weights_leave(monkeypatch):
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cache_memory(torch.device("cpu"), 1000) == int((ram - 1000) * CACHE_MEMORY_FRACTION)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80_000, 141_000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30_000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 26_000)
    # free device memory (the weights are already in use) plus what PyTorch's allocator caches unused
    assert cache_memory(torch.device("cuda"), 10**9) == 42_000


# every path uses it -----------------------------------------------------------------------------


def test_one_set_of_engine_defaults():
    """Every way in (the CLIs' flags, a sweep configuration, lm-eval's model_args, LLM's keywords) takes
    its engine defaults from EngineConfig, and the source spells each default once."""
    defaults = EngineConfig()
    assert (defaults.max_model_len, defaults.max_num_seqs, defaults.max_num_batched_tokens) == (None, 32, 512)
    flags = [parse("generate", "--prompt", "x"), parse("audit", "run", "--suite", "smoke", "--out", "o"),
             parse("audit", "replay", "record", "--traces", "t", "--out", "o")]
    configs = [config_from_flags(args, seed=0) for args in flags] + [Variant.of("v").engine]
    assert all(config == defaults for config in configs)
    resolved = dataclasses.replace(defaults, max_model_len=64, weight_storage="decoded")  # auto, on a CPU
    assert LLM("preset:tiny", max_model_len=64).engine_config == resolved
    sources = "".join(path.read_text() for folder in ("deepinfer", "harness")
                      for path in (Path(__file__).parent.parent / folder).rglob("*.py"))
    assert len(re.findall(r"max_num_seqs\b[^=\n]*= *_setting\(", sources)) == 1


def test_the_engine_serves_a_long_prompt_at_the_models_length(tiny_checkpoint):
    llm = LLM(tiny_checkpoint)
    assert llm.max_model_len == TINY_POSITIONS
    [out] = llm.generate([long_prompt()], SamplingParams(**GREEDY))
    assert (len(out.prompt_token_ids), len(out.token_ids), out.finish_reason) == (LONG, 2, "length")


def test_without_chunked_prefill_the_step_budget_covers_max_model_len(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_model_len=300, max_num_batched_tokens=32, enable_chunked_prefill=False)
    assert llm.max_num_batched_tokens == 300
    assert LLM(tiny_checkpoint, max_model_len=300, max_num_batched_tokens=32).max_num_batched_tokens == 32
    llm.add_request(list(range(2, 301)), SamplingParams(**GREEDY))
    [chunk] = llm.scheduler.schedule().chunks  # the whole 299-token prompt in one step
    assert chunk.num_tokens == 299


def test_generate_serves_a_long_prompt_by_default_and_refuses_it_at_1024(capsys, tiny_checkpoint, tmp_path):
    prompts = write_lines(tmp_path / "long.jsonl", [{"prompt_token_ids": long_prompt()}])
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompts-file", str(prompts), "--max-tokens", "2"]
    assert engine_cli.main(argv) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["prompt_tokens"], len(row["token_ids"]), row["finish_reason"]) == (LONG, 2, "length")
    assert engine_cli.main([*argv, "--max-model-len", "1024"]) == 2
    assert capsys.readouterr().err == (f"error: {prompts}:1: prompt has {LONG} tokens but max_model_len is 1024 "
                                       "(room is needed to generate)\n")


def assert_served_at_the_models_length(run_dir: Path) -> None:
    run = read_run(run_dir)
    assert run.manifest["engine"]["max_model_len"] == TINY_POSITIONS  # the resolved value, not None
    assert run.manifest["variant"]["max_model_len"] is None  # what was asked for
    [row] = run.streams.to_dicts()
    assert (len(row["prompt_token_ids"]), len(row["token_ids"]), row["finish_reason"]) == (LONG, 2, "length")


@pytest.fixture(scope="module")
def long_suite(tmp_path_factory) -> Path:
    rows = [{"id": "long", "prompt_token_ids": long_prompt(), "sampling": GREEDY}]
    return write_lines(tmp_path_factory.mktemp("suite") / "long.jsonl", rows)


def test_audit_run_records_the_resolved_length(capsys, tiny_checkpoint, long_suite, tmp_path):
    assert main(["audit", "run", "--model", str(tiny_checkpoint), "--suite", str(long_suite),
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert_served_at_the_models_length(tmp_path / "run")


def test_a_sweep_file_without_max_model_len_leaves_it_to_the_engine(tiny_checkpoint, long_suite, tmp_path):
    sweep_file = tmp_path / "sweep.json"
    sweep_file.write_text(json.dumps({"reference": {"name": "ref"}, "variants": [{"name": "b1", "max_num_seqs": 1}]}))
    sweep = load_sweep(sweep_file)
    assert sweep.reference.engine.max_model_len is None and sweep.variants[0].engine.max_model_len is None
    record_run(tiny_checkpoint, load_suite(str(long_suite)), sweep.reference, tmp_path / "run", progress=False)
    assert_served_at_the_models_length(tmp_path / "run")


def test_replay_record_records_the_resolved_length_and_verify_rebuilds_it(capsys, tiny_checkpoint, tmp_path):
    question = "the weather in Oslo is rainy. " * 270  # about 3000 tokens in the chat template
    episode = {"id": "long", "sampling": GREEDY,
               "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "Pack a coat."}]}
    traces = write_lines(tmp_path / "traces.jsonl", [episode])
    cassette_path = tmp_path / "cassette.jsonl"
    assert main(["audit", "replay", "record", "--traces", str(traces), "--out", str(cassette_path),
                 "--model", str(tiny_checkpoint)]) == 0
    cassette = read_cassette(cassette_path)
    manifest = cassette.header["manifest"]
    assert manifest["engine"]["max_model_len"] == manifest["variant"]["max_model_len"] == TINY_POSITIONS
    [turn] = cassette.episodes[0].recording.turns
    assert len(turn.token_ids) == 2 and turn.finish_reason == "length"
    assert cassette_engine(cassette).max_model_len == TINY_POSITIONS


def test_the_default_sweep_still_forces_preemption_at_the_models_length(tiny_checkpoint, tmp_path):
    """Over every fourth smoke request (10: text, token-id, chat, tool and structured rows, prompts up to 657
    tokens) the preemption variant preempts 7 times; the whole set (195 preemptions) took 45 s."""
    sweep = {v.name: v for _, v in default_sweep().configurations()}
    (tmp_path / "suite.jsonl").write_text("".join((SHIPPED / "smoke.jsonl").read_text().splitlines(True)[::4]))
    suite = load_suite(f"native:{tmp_path / 'suite.jsonl'}")
    roots = {name: record_run(tiny_checkpoint, suite, sweep[name], tmp_path / name, progress=False)
             for name in ("batch-32", "preemption")}
    preempted = read_run(tmp_path / "preemption").manifest["engine"]
    assert preempted["max_model_len"] == TINY_POSITIONS
    # the window and state pools get 12 blocks; the entry pools one sequence's worth at 4096 tokens
    assert preempted["cache_blocks"] == {"window": 12, "csa_state": 12, "csa_entries": 65, "hca_state": 12,
                                         "hca_entries": 17}
    assert json.loads((tmp_path / "preemption" / "stats.json").read_text())["preemptions"] > 0
    assert roots["preemption"] == roots["batch-32"]


# seeds of unseeded requests --------------------------------------------------------------------

SAMPLED = SamplingParams(temperature=0.9, top_k=50, max_tokens=12, ignore_eos=True)


def prompts(n: int, offset: int) -> list[list[int]]:
    return [[2 + (offset + 31 * i + j) % 1000 for j in range(5 + 3 * i)] for i in range(n)]


def test_content_seeds_do_not_depend_on_order_or_batch(tiny_checkpoint):
    target = prompts(1, 500)[0]
    fresh = LLM(tiny_checkpoint, unseeded_seeds="content")
    [alone] = fresh.generate([target], SAMPLED)
    assert alone.seed == derive_seed(0, request_content_hash(target, SAMPLED), CONTENT_SEEDS)

    busy = LLM(tiny_checkpoint, unseeded_seeds="content")
    busy.generate(prompts(3, 0), SAMPLED)  # requests served before
    others = prompts(3, 100)
    batched = busy.generate([others[0], others[1], target, others[2]], SAMPLED)
    assert batched[2].seed == alone.seed
    assert batched[2].token_ids == alone.token_ids and batched[2].logprobs == alone.logprobs
    assert len({out.seed for out in batched}) == 4  # other content, other seeds
    assert LLM(tiny_checkpoint, unseeded_seeds="content", seed=1).generate([target], SAMPLED)[0].seed != alone.seed


def test_request_order_seeds_are_the_default_and_follow_the_request_counter(tiny_checkpoint):
    target = prompts(1, 500)[0]
    llm = LLM(tiny_checkpoint)
    [first] = llm.generate([target], SAMPLED)
    later = llm.generate([*prompts(2, 0), target], SAMPLED)
    assert (first.seed, later[2].seed) == (derive_seed(0, 0), derive_seed(0, 3))
    assert later[2].token_ids != first.token_ids  # the same request, another position: other draws
    [replayed] = LLM(tiny_checkpoint).generate([target], SamplingParams(**{**SAMPLED.to_dict(), "seed": later[2].seed}))
    assert replayed.token_ids == later[2].token_ids  # the reported seed reproduces it


def test_content_seeds_never_change():
    """Outputs record these seeds; a rerun must derive them again."""
    digest = request_content_hash([5, 6, 7], SamplingParams(temperature=0.9, max_tokens=4))
    assert digest == CONTENT_DIGEST
    assert derive_seed(0, digest, CONTENT_SEEDS) == CONTENT_SEED


def test_unknown_unseeded_seeds_is_refused(tiny_checkpoint):
    with pytest.raises(DeepInferError, match="^unknown unseeded_seeds 'order' \\(expected one of request_order, "
                                             "content\\)$"):
        LLM(tiny_checkpoint, unseeded_seeds="order")


def test_generate_content_seeds_are_the_same_in_any_order(capsys, tiny_checkpoint, tmp_path):
    rows = [{"prompt_token_ids": p} for p in prompts(3, 700)]
    base = ["generate", "--model", str(tiny_checkpoint), "--temperature", "0.9", "--max-tokens", "6"]

    def seeds_and_tokens(lines: list[dict], *flags: str) -> list[tuple]:
        assert engine_cli.main([*base, "--prompts-file", str(write_lines(tmp_path / "p.jsonl", lines)), *flags]) == 0
        return [(row["seed"], row["token_ids"]) for row in map(json.loads, capsys.readouterr().out.splitlines())]

    forward = seeds_and_tokens(rows, "--unseeded-seeds", "content")
    backward = seeds_and_tokens(rows[::-1], "--unseeded-seeds", "content")
    assert backward == forward[::-1]
    by_order = seeds_and_tokens(rows)
    assert [seed for seed, _ in by_order] == [derive_seed(0, i) for i in range(3)]
    assert [seed for seed, _ in seeds_and_tokens(rows[::-1])] == [seed for seed, _ in by_order]


def _resident_mb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS:"))


def test_a_default_cache_for_a_million_positions_takes_ram_only_as_it_fills(tiny_checkpoint, tmp_path):
    """max_position_embeddings of 1M: the default cache is sized for it (from physical RAM, the same on
    every run), but its pages are committed only when written, so the engine's resident memory grows by
    what its sequences use, not by the cache's size; the cache still reads as zeros."""
    folder = tmp_path / "long"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 20}))
    before = _resident_mb()
    llm = LLM(folder)
    cache_mb = sum(t.numel() * t.element_size() for t in llm.cache.storage.values()) >> 20
    output = llm.generate([list(range(2, 300))], SamplingParams(max_tokens=4))[0]
    grown = _resident_mb() - before
    assert output.finish_reason == "length" and llm.max_model_len > 64 * 1024
    assert cache_mb > 2048 and grown < 600, (cache_mb, grown)
    assert not llm.cache.storage[next(iter(llm.cache.storage))][:, -4096:].any()  # untouched rows read as zeros
