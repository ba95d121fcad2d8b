"""Engine configurations and sweeps: a reference configuration, the variants the determinism contract
covers (compared with the reference), and controls that are reported but do not decide the verdict.

A sweep file is JSON: {"reference": {...}, "variants": [{...}, ...], "controls": [{...}, ...]} where
each configuration is an object of `Variant` fields (`name` required). Fields left out take the
reference's values, so a variant names only what it changes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

import kernels
from deepinfer.engine.llm import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, resolve_device, resolve_dtype
from deepinfer.errors import DeepInferError

ROLES = ("reference", "variant", "control")


@dataclass(frozen=True)
class Variant:
    """One engine configuration; engine fields default to `LLM`'s (`max_model_len=None`: the engine
    derives it from the model, and runs record the resolved value). `stagger=k` starts with k
    requests and admits one more every k steps, so requests join while others decode; `shuffle`
    submits in a seeded random order; `threads` sets PyTorch's CPU thread count for the run (None:
    the process's)."""

    name: str
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_chunked_prefill: bool = True
    num_cache_blocks: int | None = None
    max_model_len: int | None = None
    shuffle: bool = False
    stagger: int = 0
    numerics: str = "batch_invariant"
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None

    def engine_kwargs(self) -> dict:
        """Keyword arguments for `LLM(...)`."""
        return dict(device=self.device, dtype=self.dtype, numerics=self.numerics, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    enable_chunked_prefill=self.enable_chunked_prefill, num_cache_blocks=self.num_cache_blocks,
                    max_model_len=self.max_model_len)

    def to_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def cpu_threads(count: int | None) -> Iterator[None]:
    """Run the enclosed code with PyTorch's CPU thread count set to `count` (None: unchanged)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Sweep:
    reference: Variant
    variants: tuple[Variant, ...]
    controls: tuple[Variant, ...] = ()

    def configurations(self) -> list[tuple[str, Variant]]:
        """(role, variant) in run order: the reference first."""
        return ([("reference", self.reference)] + [("variant", v) for v in self.variants]
                + [("control", v) for v in self.controls])

    def to_dict(self) -> dict:
        return {"reference": self.reference.to_dict(), "variants": [v.to_dict() for v in self.variants],
                "controls": [v.to_dict() for v in self.controls]}


def default_sweep(dtype: str = "float32", device: str = "cpu") -> Sweep:
    """The sweep `make certify` runs: batch sizes 1/8/32, shuffled, staggered, chunk 32, forced
    preemption, on CPU one thread, and a `fast` numerics control. The preemption variant's 12 blocks
    per cache pool (raised to one sequence's worth where that is more, see `CacheManager`) hold under
    two sequences' sliding-window rows at a 64-token step whatever max_model_len resolves to, so the
    requests must take turns."""
    reference = Variant("batch-32", max_num_seqs=32, dtype=dtype, device=device)
    variants = (
        replace(reference, name="batch-1", max_num_seqs=1),
        replace(reference, name="batch-8", max_num_seqs=8),
        replace(reference, name="shuffled", shuffle=True),
        replace(reference, name="staggered", stagger=2),
        replace(reference, name="chunk-32", max_num_batched_tokens=32),
        replace(reference, name="preemption", max_num_batched_tokens=64, num_cache_blocks=12),
    )
    if device == "cpu":
        variants += (replace(reference, name="threads-1", threads=1),)
    return Sweep(reference, variants, (replace(reference, name="fast", numerics="fast"),))


def load_sweep(path: str | Path) -> Sweep:
    """Read and validate a sweep file; every error names the file and the entry."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise DeepInferError(f"{path}: cannot read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DeepInferError(f"{path}: not valid JSON ({getattr(err, 'msg', err)})") from None
    if not isinstance(data, dict) or "reference" not in data:
        raise DeepInferError(f"{path}: expected an object with 'reference', 'variants' and optional 'controls'")
    unknown = set(data) - {"reference", "variants", "controls"}
    if unknown:
        raise DeepInferError(f"{path}: unknown key(s) {sorted(unknown)}")
    reference = _variant(data["reference"], None, f"{path}: reference")
    groups = {}
    for key in ("variants", "controls"):
        entries = data.get(key, [])
        if not isinstance(entries, list):
            raise DeepInferError(f"{path}: '{key}' must be a list")
        groups[key] = tuple(_variant(e, reference, f"{path}: {key}[{i}]") for i, e in enumerate(entries))
    sweep = Sweep(reference, groups["variants"], groups["controls"])
    names = [v.name for _, v in sweep.configurations()]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DeepInferError(f"{path}: configuration names must be unique, repeated: {duplicates}")
    if not sweep.variants:
        raise DeepInferError(f"{path}: needs at least one entry in 'variants' to compare with the reference")
    return sweep


def _variant(entry: object, base: Variant | None, where: str) -> Variant:
    if not isinstance(entry, dict):
        raise DeepInferError(f"{where}: expected an object")
    types = {f.name: f.type for f in fields(Variant)}
    unknown = set(entry) - set(types)
    if unknown:
        raise DeepInferError(f"{where}: unknown field(s) {sorted(unknown)}")
    if "name" not in entry:
        raise DeepInferError(f"{where}: 'name' is required")
    for key, value in entry.items():
        if not _fits(types[key], value):
            raise DeepInferError(f"{where}: '{key}' must be {types[key]}, got {value!r}")
    return check_variant(Variant(**{**(base.to_dict() if base else {}), **entry}), where)


def check_variant(variant: Variant, where: str) -> Variant:
    """Reject settings the engine would refuse, before any configuration runs. Names become folder
    names, so they are restricted to letters, digits, '-', '_' and '.'."""
    name = variant.name
    if not name or name.startswith(".") or not all(c.isalnum() or c in "-_." for c in name):
        raise DeepInferError(f"{where}: 'name' must be a non-empty string of letters, digits, '-', '_', '.' "
                             f"(not starting with '.'), got {name!r}")
    if variant.numerics not in kernels.NUMERICS:
        raise DeepInferError(f"{where}: 'numerics' must be one of {list(kernels.NUMERICS)}, got {variant.numerics!r}")
    try:
        resolve_dtype(variant.dtype)
    except DeepInferError as err:
        raise DeepInferError(f"{where}: {err}") from None
    sizes = [n for n in (variant.max_num_seqs, variant.max_num_batched_tokens, variant.max_model_len) if n is not None]
    if min(sizes) < 1 or variant.stagger < 0:
        raise DeepInferError(f"{where}: max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1, "
                             "stagger >= 0")
    if variant.num_cache_blocks is not None and variant.num_cache_blocks < 1:
        raise DeepInferError(f"{where}: num_cache_blocks must be >= 1")
    cores = os.cpu_count() or 1
    if variant.threads is not None and not 1 <= variant.threads <= cores:
        raise DeepInferError(f"{where}: threads must be between 1 and this machine's {cores} CPUs, "
                             f"got {variant.threads}")
    try:
        resolve_device(variant.device)
    except DeepInferError as err:
        raise DeepInferError(f"{where}: {err}") from None
    return variant


def _fits(annotation: str, value: object) -> bool:
    if annotation == "bool":
        return isinstance(value, bool)
    if value is None:
        return "None" in annotation
    if annotation.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, str)
