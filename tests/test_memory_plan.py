"""The memory plan (`deepinfer.engine.memory_plan`, `deepinfer plan`): its bytes are what an engine holds
(weights as stored or widened, the draft model, the caches), a rank of expert parallelism holds its share
of the routed experts, a layout that does not fit is refused in one line naming what overflows, and an
engine refuses such a model before loading anything."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from deepinfer import LLM, EngineConfig
from deepinfer.checkpoint import checkpoint_config, preset_config
from deepinfer.cli import main
from deepinfer.engine.memory_plan import (
    CACHES, DRAFT, ENGRAM, EXCHANGE, EXPERTS, HEADROOM, SHARED, PlanError, check_fits, plan_memory,
)
from deepinfer.errors import DeepInferError
from deepinfer.parallel.experts import exchange_capacity
from deepinfer.kernels.quant import QuantizedWeight

GIB = 2**30
H200 = 143771 * 2**20


def _held_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters, buffers and stored-format weights, each tensor once."""
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, QuantizedWeight):
                tensors += [value.data, value.scale]
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return sum(unique.values())


def _parts(plan) -> dict[str, int]:
    return {part.name: part.bytes for part in plan.parts}


@pytest.mark.parametrize("model, settings", [
    ("preset:tiny", {"dtype": "float32"}),
    ("preset:v41-tiny", {"dtype": "bfloat16", "speculation": "dspark"}),
    ("v41-quantized", {"dtype": "bfloat16", "weight_storage": "quantized"}),
])
def test_the_plan_is_what_an_engine_holds(model, settings, v41_checkpoint) -> None:
    """Weights (as stored: MXFP4 / FP8 with E8M0 scales; or widened), the draft model and the caches, to
    the byte, on the engine that the plan's settings make."""
    model = v41_checkpoint if model == "v41-quantized" else model
    llm = LLM(model, max_model_len=512, **settings)
    plan = plan_memory(str(model), llm.config, llm.engine_config, 1, 2**40, headroom_fraction=0.0)
    parts = _parts(plan)
    assert HEADROOM not in parts and EXPERTS in parts and SHARED in parts
    assert sum(v for k, v in parts.items() if k in (SHARED, EXPERTS, ENGRAM)) == _held_bytes(llm.host.model)
    assert parts[CACHES] == sum(t.numel() * t.element_size() for t in llm.cache.storage.values())
    if "speculation" in settings:
        llm.generate([[5, 6, 7]])  # the draft model is made on first use
        assert parts[DRAFT] == _held_bytes(llm.host.draft_model("dspark", True))
    if "weight_storage" in settings:
        assert "MXFP4 with E8M0 scales" in next(p.detail for p in plan.parts if p.name == EXPERTS)


def test_a_rank_of_expert_parallelism_holds_its_share_of_the_routed_experts() -> None:
    config = preset_config("v41-flash")
    base = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096)
    one = _parts(plan_memory("v41-flash", config, base, 1, H200))
    for gpus in (2, 4, 8):
        share = _parts(plan_memory("v41-flash", config, replace(base, expert_parallel=gpus), gpus, H200))
        assert share[EXPERTS] == one[EXPERTS] // gpus  # 384 experts: every rank holds 384 / gpus
        assert share[SHARED] == one[SHARED] and share[ENGRAM] == one[ENGRAM] and share[CACHES] == one[CACHES]


def test_full_size_layouts_on_h200s() -> None:
    """V4.1-Flash keeps its Engram tables whole on every rank: they fit in host memory, not beside the
    experts of 8 H200s; V4-Flash (bf16) fits 8 with expert parallelism, not 4."""
    v41, flash = preset_config("v41-flash"), preset_config("flash")
    engine = EngineConfig(device="cuda", dtype="bfloat16")
    on_device = plan_memory("v41-flash", v41, replace(engine, expert_parallel=8), 8, H200)
    with pytest.raises(PlanError) as err:
        check_fits(on_device)
    assert str(err.value) == (
        "v41-flash on 8 GPUs of 140.4 GiB (EP 8): a rank needs 245.9 GiB, 105.5 GiB more than its card; the largest "
        "part is Engram tables (188.8 GiB): keep them in host memory (--engram-tables host)")
    host = plan_memory("v41-flash", v41, replace(engine, expert_parallel=8, engram_tables="host"),
                       8, H200)
    check_fits(host)
    assert host.host_total == _parts(on_device)[ENGRAM] and host.max_model_len > 100_000
    check_fits(plan_memory("flash", flash, replace(engine, expert_parallel=8), 8, H200))
    with pytest.raises(PlanError, match=r"^flash on 4 GPUs of 140\.4 GiB \(EP 4\): .* the largest part is routed "
                                        r"experts \(129\.0 GiB\): spread them over more processes"):
        check_fits(plan_memory("flash", flash, replace(engine, expert_parallel=4), 4, H200))


def test_a_fixed_capacity_exchange_is_planned_at_the_largest_step() -> None:
    """With expert_capacity a rank also holds the exchange's buffers for one MoE layer of a step of the
    whole budget: ranks x capacity rows (the capacity the engine gives its exchanges) of five hidden-wide
    rows (sent, received, through the experts, returned, laid back) and three intermediate-wide ones,
    and two expert-slot lists; a factor whose buffers do not fit is refused, named."""
    config = preset_config("v41-flash")
    engine = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=2048,
                          expert_parallel=8, data_parallel=8, engram_tables="host")
    assert EXCHANGE not in _parts(plan_memory("v41-flash", config, engine, 8, H200))
    plan = plan_memory("v41-flash", config, replace(engine, expert_capacity=2.0), 8, H200)
    capacity = 2 * 2048 * 6 // 8  # twice a rank's even share: 2,048 rows of 6 slots, an eighth to each rank
    assert capacity == exchange_capacity(2.0, 2048, 1, 6, 8)
    rows = 8 * capacity
    assert _parts(plan)[EXCHANGE] == rows * (5 * 5120 + 3 * 2304) * 2 + 16 * rows
    assert next(p.detail for p in plan.parts if p.name == EXCHANGE) == (
        "3072 rows per rank pair and MoE layer at a 2048-token step")
    with pytest.raises(PlanError, match=r"the largest part is expert exchange \([\d.]+ GiB\): lower --expert-capacity "
                                        r"or --max-num-batched-tokens$"):
        check_fits(plan_memory("v41-flash", config, replace(engine, expert_capacity=256.0), 8, H200))


def test_host_engram_tables_read_from_files_as_stored_are_one_copy_a_machine(v41_checkpoint, capsys) -> None:
    """Engram tables a checkpoint folder holds, kept in host memory as stored, are the file's mapped pages
    (tests/test_checkpoint_v41.py checks it): the plan counts them once for a machine's ranks; a
    preset's (generated in each process) or widened ones once per rank."""
    engine = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, engram_tables="host",
                          expert_parallel=4)
    config = checkpoint_config(v41_checkpoint)  # the release's formats: FP8 tables with their scales
    table = {p.name: p for p in plan_memory("v41-tiny", config, engine, 4, H200).parts}[ENGRAM]
    shared = plan_memory(str(v41_checkpoint), config, engine, 4, H200, from_files=True)
    widened = plan_memory(str(v41_checkpoint), config, replace(engine, weight_storage="decoded"), 4, H200,
                          from_files=True)
    generated = plan_memory("v41-tiny", config, engine, 4, H200)
    assert shared.machine_host_total == table.bytes and generated.machine_host_total == 4 * table.bytes
    assert widened.machine_host_total == 4 * widened.host_total
    assert main(["plan", "--model", str(v41_checkpoint), "--gpus", "4", "--expert-parallel", "4",
                 "--engram-tables", "host"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert next(line for line in out if line.split()[:2] == ["Engram", "tables"]).endswith(
        "(host memory, the checkpoint file's pages: one copy a machine)")


def test_caches_that_overflow_are_named() -> None:
    engine = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=65536, max_num_seqs=256)
    plan = plan_memory("v41-tiny", preset_config("v41-tiny"), engine, 1, GIB)
    with pytest.raises(PlanError) as err:
        check_fits(plan)
    assert str(err.value).endswith("the largest part is caches (4.6 GiB): lower --max-model-len or --max-num-seqs")


def test_degrees_are_one_or_every_gpu() -> None:
    with pytest.raises(DeepInferError) as err:
        plan_memory("tiny", preset_config("tiny"), EngineConfig(expert_parallel=2), 4, H200)
    assert str(err.value) == "expert_parallel=2: a degree is 1 or the number of GPUs (4)"


def test_an_engine_refuses_a_model_its_machine_cannot_hold_before_loading_it() -> None:
    """The full V4-Flash on this CPU: one line, at once (its weights would take minutes to make)."""
    with pytest.raises(PlanError, match=r"^preset:flash on a CPU machine of [\d.]+ GiB \(one process\): a rank needs "
                                        r"[\d.]+ GiB, [\d.]+ GiB more than its memory; the largest part is routed "
                                        r"experts"):
        LLM("preset:flash")


def test_plan_command(capsys) -> None:
    assert main(["plan", "--model", "v41-flash", "--gpus", "8", "--expert-parallel", "8", "--engram-tables", "host",
                 "--gpu-memory", "140.4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("v41-flash on 8 GPUs of 140.4 GiB (EP 8, weights as stored, bfloat16, max_model_len ")
    assert any(line.split()[:2] == ["routed", "experts"] and "48 of 384 per MoE layer" in line for line in out)
    engram = next(line for line in out if line.split()[:2] == ["Engram", "tables"])
    assert engram.endswith("(host memory, a copy per rank)") and out[-1].startswith("fits: ")  # a preset's: generated
    assert next(line for line in out if "host total" in line).endswith("1510.7 for the 8 ranks of one machine")
    assert main(["plan", "--model", "preset:flash", "--gpus", "2", "--expert-parallel", "2",
                 "--gpu-memory", "140.4"]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].startswith("does not fit: ")
    assert captured.err.startswith("error: preset:flash on 2 GPUs of 140.4 GiB (EP 2): a rank needs ")


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--gpus", "0"], "error: --gpus must be at least 1, got 0"),
    (["--model", "tiny", "--gpu-memory", "-1"], "error: --gpu-memory must be a positive number of GiB, got -1.0"),
    (["--model", "no-such-folder"], "error: no-such-folder: checkpoint folder not found"),
    (["--model", "tiny", "--gpus", "4", "--data-parallel", "2"],
     "error: data_parallel=2: a degree is 1 or the number of GPUs (4)"),
])
def test_plan_refuses_bad_flags_in_one_line(argv, message, capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert capsys.readouterr().err.strip() == message
