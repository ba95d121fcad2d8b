"""Where a run ran: the environment fingerprint, the git state and the engine version that the
harness passes to `audit.manifest.build_manifest`.

Every probe is best effort: a field that cannot be read is None rather than a failed run, since the
manifest documents a run and must never be the reason it fails.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from deepinfer.kernels.cpu_isa import cpu_flags, cpu_model, cpu_vendor

FINGERPRINTED_PACKAGES = ("torch", "triton", "numpy", "polars")
NVIDIA_DRIVER_VERSION = re.compile(r"\s(\d+\.\d+(?:\.\d+)?)\s")  # in /proc/driver/nvidia/version
SOURCE_DIR = Path(__file__).resolve().parent.parent  # the checkout this package was loaded from


def _probe(read: Callable[[], object]) -> object:
    try:
        return read()
    except Exception:
        return None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except Exception:  # not installed, or broken metadata
        return None


def engine_version() -> str:
    """This project's installed version ("unknown" without package metadata); its distribution is
    `deepinfer-repro` (pyproject.toml): `deepinfer` is DeepSeek's."""
    return _package_version("deepinfer-repro") or "unknown"


def _nvidia_driver() -> str | None:
    """The kernel driver version (e.g. "550.54.15"); torch only knows the CUDA runtime it was built with."""
    version_file = Path("/proc/driver/nvidia/version")
    if not version_file.is_file():
        return None
    match = NVIDIA_DRIVER_VERSION.search(version_file.read_text(errors="replace"))
    return match.group(1) if match else None


def _cuda() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {
        "version": torch.version.cuda,
        "driver": _probe(_nvidia_driver),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def _onednn() -> dict:
    from deepinfer.kernels.cpu_isa import onednn_state

    return onednn_state()


def _mkl() -> dict:
    from deepinfer.kernels.cpu_isa import probe_mkl

    return probe_mkl()


def _selftests() -> dict:
    from deepinfer.kernels.selftest import results

    return results()


def _torch_cpu() -> dict:
    """What decides the CPU kernels' code paths: PyTorch's vector ISA, its thread count, MKL's
    conditional-numerical-reproducibility setting and ISA limit (MKL_CBWR, MKL_ENABLE_INSTRUCTIONS),
    oneDNN's ISA cap as set (ONEDNN_MAX_CPU_ISA) and as in effect (`kernels.cpu_isa.onednn_state`:
    the ISA and the fp32 and bf16 kernels oneDNN uses, whether AMX is available and used, a waiver if
    one was set), MKL's code path as it reports it (`kernels.cpu_isa.probe_mkl`), and the start
    self-tests of the batch-invariant primitives this process ran (`kernels.selftest.results`)."""
    import torch

    return {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "onednn": _probe(_onednn),
            "mkl": _probe(_mkl), "selftest": _probe(_selftests)}


def environment_fingerprint() -> dict:
    """Hardware and software of this process: Python, OS, CPU, key package versions, CUDA and GPUs."""
    return {
        "python": _probe(platform.python_version),
        "implementation": _probe(platform.python_implementation),
        "os": _probe(platform.system),
        "platform": _probe(platform.platform),
        "machine": _probe(platform.machine),
        "cpu": _probe(cpu_model),
        "cpu_vendor": _probe(cpu_vendor),
        "cpu_flags": _probe(cpu_flags),
        "cpu_count": _probe(os.cpu_count),
        "torch_cpu": _probe(_torch_cpu),
        "packages": {name: _package_version(name) for name in FINGERPRINTED_PACKAGES},
        "cuda": _probe(_cuda),
    }


def _git(repo_dir: str | os.PathLike, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def git_state(repo_dir: str | os.PathLike = SOURCE_DIR) -> dict:
    """{"commit": HEAD sha, "dirty": uncommitted or untracked changes} of `repo_dir` (by default the
    checkout this package was loaded from); None values outside a git checkout."""
    head = _git(repo_dir, "rev-parse", "HEAD")
    status = _git(repo_dir, "status", "--porcelain") if head is not None else None
    return {
        "commit": head.strip() if head is not None else None,
        "dirty": bool(status.strip()) if status is not None else None,
    }
