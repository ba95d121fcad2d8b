"""Engine configurations and sweeps: a reference configuration, the variants the determinism contract
covers (compared with the reference), and controls that are reported but do not decide the verdict.

A sweep file is JSON: {"reference": {...}, "variants": [{...}, ...], "controls": [{...}, ...]} where
each configuration is a flat object: `name` (required), any `EngineConfig` setting but `seed` (the
suite gives the run seed), and `shuffle`, `stagger`, `threads`, `warm`, `shards`. Fields left out take the reference's
values, so a variant names only what it changes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path


from deepinfer.checkpoint import CheckpointError, default_checkpoint, inspect_checkpoint, preset_config
from deepinfer.families.registry import family_of
from deepinfer.engine.config import EngineConfig, parse_device, resolve_device
from deepinfer.engine.host import PRESET_PREFIX
from deepinfer.errors import DeepInferError

ROLES = ("reference", "variant", "control")
RUN_FIELDS = ("shuffle", "stagger", "threads", "warm", "shards")
MAX_SHARDS = 64  # each shard that has requests is an engine of its own, with its own cache
# The run seed comes from the suite, so a configuration does not set the engine's seed.
ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig) if f.name != "seed")


@dataclass(frozen=True)
class Variant:
    """One configuration of a sweep: a name, an `EngineConfig`, and how requests reach the engine.
    `stagger=k` starts with k requests and admits one more every k steps, so requests join while
    others decode; `shuffle` submits in a seeded random order; `threads` sets PyTorch's CPU thread
    count for the run (None: the process's); `warm` serves every request once, unrecorded, before
    the pass that counts, in the same engine (with prefix caching, each request then finds its own
    prompt's blocks cached); `shards=n` splits the suite round robin into n shares, each served by an
    engine of its own over the same weights, into one run (a torchrun launch gives each rank a
    share). In files and certificates a configuration is one flat object: `name`,
    the engine settings and the run fields."""

    name: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    shuffle: bool = False
    stagger: int = 0
    threads: int | None = None
    warm: bool = False
    shards: int = 1

    @classmethod
    def of(cls, name: str, **settings) -> "Variant":
        """From flat settings: engine fields and run fields by name."""
        run = {key: settings.pop(key) for key in RUN_FIELDS if key in settings}
        return cls(name, EngineConfig(**settings), **run)

    def derive(self, name: str, **settings) -> "Variant":
        """This configuration under another name with some flat settings changed."""
        run = {key: settings.pop(key) for key in RUN_FIELDS if key in settings}
        return replace(self, name=name, engine=replace(self.engine, **settings), **run)

    def to_dict(self) -> dict:
        engine = asdict(self.engine)
        return {"name": self.name, **{key: engine[key] for key in ENGINE_FIELDS},
                **{key: getattr(self, key) for key in RUN_FIELDS}}


# The factors the determinism contract names (deepinfer/ARCHITECTURE.md §1), one configuration each as
# settings over a reference: `default_sweep` (over batch-32) and the invariance matrix
# (`harness/invariance.py`, over all-at-once) run every one; benchmarks/ep_invariance.py picks some.
# Preemption: 12 blocks per cache pool (raised to one sequence's worth where that is more, see
# `CacheManager`) hold under two sequences' sliding-window rows at a 64-token step whatever
# max_model_len resolves to, so the requests must take turns.
FACTORS: tuple[tuple[str, dict], ...] = (
    ("batch-1", {"max_num_seqs": 1}),
    ("batch-3", {"max_num_seqs": 3}),
    ("batch-8", {"max_num_seqs": 8}),
    ("shuffled", {"shuffle": True}),
    ("staggered", {"stagger": 2}),
    ("chunk-16", {"max_num_batched_tokens": 16}),
    ("chunk-64", {"max_num_batched_tokens": 64}),
    ("chunk-off", {"enable_chunked_prefill": False}),
    ("preemption", {"max_num_batched_tokens": 64, "num_cache_blocks": 12}),
    ("sync-steps", {"async_scheduling": False}),
    ("speculation", {"speculation": "ngram"}),
    ("prefix-cold", {"prefix_caching": False}),
    ("prefix-hot", {"warm": True}),
)


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


def checkpoint_drafter(model: str | Path | None) -> str | None:
    """The `speculation` that runs `model`'s own draft model: `dspark` for V4.1 draft layers, `mtp` for a
    V4 MTP block; None when it has none (a folder is asked whether it stores them, reading headers only)
    or cannot be inspected (loading it for the first run says why, after the checks that come first).
    `model` as `LLM` takes it: a folder, `preset:NAME` or None for the default checkpoint."""
    if isinstance(model, str) and model.startswith(PRESET_PREFIX):
        config, stored = preset_config(model[len(PRESET_PREFIX):]), True
    else:
        try:
            info = inspect_checkpoint(model if model is not None else default_checkpoint())
        except CheckpointError:
            return None
        config, stored = info.config, info.has_mtp
    family = family_of(config)
    return family.speculation if stored and family.has_draft(config) else None


def draft_model_variants(base: Variant, drafter: str | None) -> tuple[Variant, ...]:
    """`base` speculating with the checkpoint's own draft model (`drafter`, from `checkpoint_drafter`;
    none when it is None): 1, 3 and 5 drafts all verified, and 5 verified only as far as the confidence
    head gives them at least a 5 % chance together, so the verified length changes from step to step."""
    if drafter is None:
        return ()
    settings = (("draft-k1", 1, 0.0), ("draft-k3", 3, 0.0), ("draft-k5", 5, 0.0), ("draft-k5-confidence", 5, 0.05))
    return tuple(base.derive(name, speculation=drafter, draft_tokens=k, draft_confidence=confidence)
                 for name, k, confidence in settings)


def default_sweep(dtype: str | None = None, device: str | None = None, drafter: str | None = None,
                  expert_parallel: int | None = None, data_parallel: int | None = None) -> Sweep:
    """The sweep `make certify` runs: over a batch-32 reference every one of FACTORS (batch sizes 1, 3
    and 8, shuffled, staggered, chunks of 16 and 64 tokens and chunking off, forced preemption, each
    step read before the next is scheduled (the others schedule asynchronously), speculative decoding
    with prompt-lookup drafts, the prefix cache off (cold) and hot (the suite served twice in one
    engine, the second pass recorded)); given the checkpoint's `drafter` (`checkpoint_drafter`),
    speculation with its own draft model (`draft_model_variants`); the suite split over three engines
    (`shards`); on CPU one thread, on CUDA every step run eagerly (the others replay decode steps from
    CUDA graphs); and a `fast` numerics control. `dtype`, `device`, `expert_parallel` and
    `data_parallel` (None: the engine's defaults) apply to every configuration."""
    settings = {"dtype": dtype, "device": device, "expert_parallel": expert_parallel, "data_parallel": data_parallel}
    given = {key: value for key, value in settings.items() if value is not None}
    reference = Variant.of("batch-32", max_num_seqs=32, **given)
    variants = tuple(reference.derive(name, **factor) for name, factor in FACTORS)
    variants += (reference.derive("shards-3", shards=3),)
    variants += draft_model_variants(reference, drafter)
    if parse_device(reference.engine.device).type == "cpu":
        variants += (reference.derive("threads-1", threads=1),)
    else:
        variants += (reference.derive("graphs-off", cuda_graphs=False),)
    return Sweep(reference, variants, (reference.derive("fast", numerics="fast"),))


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
    return variant_from_dict(entry, where, base)


def variant_from_dict(entry: dict, where: str, base: Variant | None = None) -> Variant:
    """A configuration from its flat object (fields left out take `base`'s values, else the defaults),
    checked as `check_variant` does."""
    types = {f.name: f.type for f in fields(Variant) if f.name != "engine"}  # name and the run fields
    types.update({f.name: f.type for f in fields(EngineConfig) if f.name in ENGINE_FIELDS})
    unknown = set(entry) - set(types)
    if unknown:
        raise DeepInferError(f"{where}: unknown field(s) {sorted(unknown)}")
    if "name" not in entry:
        raise DeepInferError(f"{where}: 'name' is required")
    for key, value in entry.items():
        if not _fits(types[key], value):
            raise DeepInferError(f"{where}: '{key}' must be {types[key]}, got {value!r}")
    merged = {**(base.to_dict() if base else {}), **entry}
    try:
        variant = Variant.of(**merged)
    except DeepInferError as err:
        raise DeepInferError(f"{where}: {err}") from None
    return check_variant(variant, where)


def check_variant(variant: Variant, where: str) -> Variant:
    """Reject run settings the engine cannot honour, before any configuration runs (the engine settings
    were checked when the `EngineConfig` was made; here, that this machine has its device). Names become folder names, so they are restricted
    to letters, digits, '-', '_' and '.'."""
    name = variant.name
    if not name or name.startswith(".") or not all(c.isalnum() or c in "-_." for c in name):
        raise DeepInferError(f"{where}: 'name' must be a non-empty string of letters, digits, '-', '_', '.' "
                             f"(not starting with '.'), got {name!r}")
    if variant.stagger < 0:
        raise DeepInferError(f"{where}: stagger must be >= 0, got {variant.stagger}")
    if not 1 <= variant.shards <= MAX_SHARDS:
        raise DeepInferError(f"{where}: shards must be from 1 to {MAX_SHARDS} (one engine each), got {variant.shards}")
    cores = os.cpu_count() or 1
    if variant.threads is not None and not 1 <= variant.threads <= cores:
        raise DeepInferError(f"{where}: threads must be between 1 and this machine's {cores} CPUs, "
                             f"got {variant.threads}")
    try:
        resolve_device(variant.engine.device)
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
    if annotation.startswith("float"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)
