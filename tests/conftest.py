"""Shared fixtures. `tiny_checkpoint` is built once per session: treat it as read-only (copy it with
`shutil.copytree` before changing anything)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.checkpoint import create_checkpoint


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
