"""`benchmarks/scale_sim.py`'s tokens/s prediction from one measured rank: its exchange and expert-work
terms follow the stated model, and a layout of the measured rank's own size predicts the measured step
plus its exchange and imbalance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from deepinfer.checkpoint import preset_config

SPEC = importlib.util.spec_from_file_location("scale_sim", Path(__file__).parents[1] / "benchmarks" / "scale_sim.py")
scale_sim = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(scale_sim)


def test_the_exchange_crosses_machines_over_infiniband_only_beyond_one_machine():
    config = preset_config("v41-flash")
    row_bytes = 2 * config.hidden_size * 2 * config.num_hidden_layers  # out and back, bf16, every MoE layer
    inside = scale_sim.exchange_ms(config, 8, 64, 2)
    assert inside == pytest.approx(1e3 * 64 * 6 * 7 / 8 * row_bytes / (scale_sim.NVLINK_GB_S * 1e9))
    across = scale_sim.exchange_ms(config, 64, 64, 2)  # 56 of the 63 other ranks are on other machines
    assert across == pytest.approx(1e3 * 64 * 6 * 63 / 64 * row_bytes * 56 / 63 / (scale_sim.INFINIBAND_GB_S * 1e9))


def test_expert_passes_count_experts_with_work_and_their_row_tiles():
    assert scale_sim.expert_passes(48, 6, 4608) == pytest.approx(48 * (1 - (47 / 48) ** 6))  # one tile each
    assert scale_sim.expert_passes(6, 384, 4608) == pytest.approx(6, rel=1e-6)  # all busy, 64 slots: one 64-row tile
    assert scale_sim.expert_passes(48, 384, 4608) == pytest.approx(48, rel=1e-3)  # 8 slots each: one 16-row tile


def test_the_measured_layout_predicts_its_own_step_plus_exchange_and_imbalance():
    bench = {"decode": [{"numerics": "batch_invariant", "setup": "graphs+async", "batch": 64, "step_ms": 100.0,
                         "top_kernels": [{"kernel": "_matmul_kernel", "total_us": 20_000.0},
                                         {"kernel": scale_sim.EXPERT_KERNEL, "total_us": 60_000.0}]},
                        {"numerics": "batch_invariant", "setup": "eager+async", "batch": 64, "step_ms": 400.0,
                         "top_kernels": []},
                        {"numerics": "batch_invariant", "setup": "graphs+async", "batch": 256, "step_ms": 500.0,
                         "graphs_captured_while_timed": 2, "top_kernels": []}]}
    rows = [{"gpus": 8, "busiest_rank_over_mean": {"contiguous": {"mean": 1.5}, "eplb_same_suite": {"mean": 1.0}}}]
    # the eager row is not a serving setup; the batch-256 row's timed steps captured graphs: not a replayed step
    [row] = scale_sim.predict(bench, 8, "v41-flash", rows, 2)
    assert [r["batch"] for r in scale_sim.timed_steps(bench)] == [64, 256]
    assert [r["batch"] for r in scale_sim.steady_steps(bench)] == [64]
    exchange = scale_sim.exchange_ms(preset_config("v41-flash"), 8, 64, 2)
    assert row["rank_dense_ms"] == 40.0 and row["rank_experts_ms"] == 60.0
    assert row["eplb_same_suite"]["step_ms"] == round(100 + exchange, 1)
    assert row["contiguous"]["step_ms"] == round(40 + 1.5 * 60 + exchange, 1)
    assert row["eplb_same_suite"]["tokens_per_s"] == round(8 * 64 / (100 + exchange) * 1e3)
