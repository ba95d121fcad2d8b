"""Batch invariance on the library code paths other CPUs take, reached here through MKL's and oneDNN's
environment variables (harness/cpu_paths.py): on every path the start self-test passes for fp32 and
bf16 (or the engine refuses bf16, as under AMX) and the tiny preset's requests served alone and in a
batch of 8 have the same token ids and logprob bits. So an Intel CI machine runs the paths an AMD
one takes (MKL's generic code through MKL_CBWR=COMPATIBLE, oneDNN's AVX2 kernels) and an AMD one the
paths of Intel's (MKL's AVX2 and AVX-512 paths where MKL lets them be chosen)."""

from __future__ import annotations

import pytest

from deepinfer.harness.cpu_paths import LIBRARY_PATHS, run_paths


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return run_paths()


@pytest.mark.parametrize("path", list(LIBRARY_PATHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_library_path_is_batch_invariant(reports, path, dtype):
    entry = reports[path]["dtypes"][dtype]
    assert entry["variant"] == [], f"{path}: {reports[path]['path']}"
    if entry["refused"]:
        assert dtype == "bfloat16"  # oneDNN's AMX kernels: the engine refuses bf16 (tests/test_cpu_isa.py)
        return
    assert entry["batch_invariant"], f"{path}: {reports[path]['path']}"


def test_the_paths_are_reported_as_the_libraries_name_them(reports):
    for path, report in reports.items():
        assert report["path"].count("; ") == 3 and "MKL for " in report["path"], path
    assert "CNR:OFF" in reports["default"]["path"] and "CNR:OFF" not in reports["mkl-compatible"]["path"]
    assert "; PyTorch kernels AVX2; " in reports["avx2-cpu"]["path"]
