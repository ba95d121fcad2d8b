"""Loading and validating checkpoints against the layout their config implies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.checkpoint.errors import CheckpointError
from deepinfer.checkpoint.files import INDEX_NAME, WeightReader, read_headers, weight_files
from deepinfer.checkpoint.hashing import TensorHasher, cached_hash, content_hash, store_hash
from deepinfer.checkpoint.layout import expected_tensors, unchecked_tensor, unused_tensor, weight_dtype_name
from deepinfer.families.v41.layout import is_draft_tensor
from deepinfer.families.tensor_spec import FP4, FP8, FP32, INDEX, MTP_PREFIX, SCALE
from deepinfer.families.v4.config import ModelConfig
from deepinfer.families.v41.config import V41Config
from deepinfer.families.registry import drafting_family, family_of, load_config
from deepinfer.kernels.quant import QuantizedWeight


@dataclass
class Checkpoint:
    folder: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor] = field(repr=False)
    has_mtp: bool
    content_hash: str
    tokenizer_path: Path | None
    formats: dict[str, str]  # `stored_formats`
    bytes_read: int = 0  # tensor bytes read from the files (a rank's share, and every tensor when hashing)


@dataclass
class CheckpointInfo:
    """What `inspect_checkpoint` learns without loading tensor data."""

    folder: Path
    config: ModelConfig
    has_weights: bool
    has_mtp: bool
    weight_dtype: str | None
    content_hash: str | None
    tokenizer_path: Path | None


def checkpoint_config(folder: str | Path):
    """A checkpoint folder's validated config alone (nothing else is read)."""
    return load_config(_existing(folder))


def load_checkpoint(folder: str | Path, device: str | torch.device = "cpu", *,
                    quantized_as: torch.dtype | None = None, needed: Callable[[str], bool] | None = None,
                    placement: Callable[[str], str | torch.device] | None = None) -> Checkpoint:
    """The checkpoint's config and tensors on `device`, validated and hashed as stored. Quantized weights
    are decoded exactly to fp32, or, given `quantized_as` (V4.1 only; V4's may carry float32 scales),
    kept as stored in `QuantizedWeight`s that decode to that dtype. Given `needed` (a rank's share of the
    experts: `deepinfer.parallel.placement.held_tensors`), only the tensors it names are read, each
    by its own offsets in its file; every header is still checked. The content hash comes from the
    cache, or else from every tensor's bytes, read one at a time (those not needed are dropped as soon
    as they are hashed). Given `placement`, each tensor is read onto the device it names instead (a
    model's host-resident tensors, e.g. V4.1's Engram tables in host memory, never pass the GPU)."""
    folder = _existing(folder)
    config = load_config(folder)
    files = weight_files(folder)
    digest = cached_hash(files)
    hasher = TensorHasher() if digest is None else None  # every tensor as stored, the unused ones included
    tensors, bytes_read = {}, 0
    with WeightReader(files, device, placement) as reader:
        has_mtp, weight_dtype, wider = check_tensors(config, reader.headers)
        for name in sorted(reader.headers):
            keep = needed is None or needed(name)
            if not keep and hasher is None:
                continue
            tensor = reader.get(name)
            bytes_read += tensor.nbytes
            if hasher is not None:
                hasher.add(name, tensor)
            if keep:
                tensors[name] = tensor
    _check_routing_tables(config, tensors)
    if hasher is not None:
        digest = hasher.hexdigest()
        store_hash(files, digest)
    tensors = {name: tensor for name, tensor in tensors.items() if not unused_tensor(config, name)}
    tensors = weights_in_memory(config, tensors, quantized_as)
    formats = stored_formats(config, weight_dtype, wider)
    return Checkpoint(folder, config, tensors, has_mtp, digest, _tokenizer(folder), formats, bytes_read)


def load_draft_tensors(folder: str | Path, device: str | torch.device = "cpu", *,
                       quantized_as: torch.dtype | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A V4.1 checkpoint's DSpark draft layers (`mtp.*`), validated with the rest of its headers and
    decoded as `load_checkpoint` decodes the backbone (`quantized_as` likewise); what
    `deepinfer.families.v41.dspark.DSpark.load_tensors` takes. The target's embedding and head are not among
    them (the draft shares the target's)."""
    return _draft_tensors(folder, device, quantized_as, "dspark")


def load_mtp_tensors(folder: str | Path, device: str | torch.device = "cpu", *,
                     quantized_as: torch.dtype | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A V4 checkpoint's MTP block (`mtp.*`), read, validated and decoded as `load_draft_tensors` reads
    V4.1's draft layers; what `deepinfer.families.v4.mtp.MTP.load_tensors` takes."""
    return _draft_tensors(folder, device, quantized_as, "mtp")


def _draft_tensors(folder: str | Path, device: str | torch.device, quantized_as: torch.dtype | None,
                   speculation: str) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The `mtp.*` tensors of a checkpoint of the family whose draft model `speculation` runs, whose
    config declares them."""
    folder = _existing(folder)
    config = load_config(folder)
    family, what = family_of(config), drafting_family(speculation).draft_name
    if family.speculation != speculation or not family.has_draft(config):
        raise CheckpointError(f"{folder}: the config has no {what}")
    with WeightReader(weight_files(folder), device) as reader:
        has_mtp, _, _ = check_tensors(config, reader.headers)
        if not has_mtp:
            raise CheckpointError(f"{folder}: the checkpoint has no {what} (mtp.* tensors)")
        tensors = {name: reader.get(name) for name in sorted(reader.headers) if is_draft_tensor(name)}
    return weights_in_memory(config, tensors, quantized_as)


def weights_in_memory(config: ModelConfig | V41Config, tensors: dict[str, torch.Tensor],
                      quantized_as: torch.dtype | None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A checkpoint's stored tensors as the engine takes them (see `load_checkpoint`)."""
    return family_of(config).weights_in_memory(config, tensors, quantized_as)


def stored_formats(config: ModelConfig | V41Config, weight_dtype: str, wider: list[str] = ()) -> dict[str, str]:
    """How the checkpoint stores its weights, by part (runs record it): `weight_dtype` throughout, or
    the quantized parts' formats (number format, scale tile, scale format) beside it, and the weights
    stored wider than `weight_dtype` (`check_tensors`), if any."""
    formats = _part_formats(config, weight_dtype)
    if wider:
        formats["float32_weights"] = ", ".join(wider[:3]) + (f" (and {len(wider) - 3} more)" if len(wider) > 3 else "")
    return formats


def _part_formats(config: ModelConfig | V41Config, weight_dtype: str) -> dict[str, str]:
    if config.quantization_config is None:
        return {"weights": weight_dtype}
    return family_of(config).quantized_formats(config, weight_dtype)


def inspect_checkpoint(folder: str | Path, *, verify: bool = False) -> CheckpointInfo:
    """Validate config and tensor headers; a folder with config.json but no weights is config-only.
    With `verify`, the content hash is computed from the weights' bytes, not taken from the cache."""
    folder = _existing(folder)
    config = load_config(folder)
    has_weights = (folder / INDEX_NAME).is_file() or any(folder.glob("*.safetensors"))
    has_mtp, dtype, digest = False, weight_dtype_name(config), None
    if has_weights:
        has_mtp, dtype, _ = check_tensors(config, read_headers(weight_files(folder)))
        digest = content_hash(folder, trust_cache=not verify)
    return CheckpointInfo(folder, config, has_weights, has_mtp, dtype, digest, _tokenizer(folder))


FIXED_DTYPES = {FP32: ("float32",), INDEX: ("int64",), FP8: ("float8_e4m3fn",), FP4: ("int8", "uint8"),
                SCALE: ("float8_e8m0fnu", "uint8")}


def check_tensors(config: ModelConfig, headers: dict[str, tuple[Path, str, tuple[int, ...]]]
                  ) -> tuple[bool, str, list[str]]:
    """Check names, shapes and dtypes (from headers) against the layout; returns (has_mtp, weight dtype,
    the weights stored wider than it: float32 in a bfloat16 checkpoint, as releases and NeMo's exports
    keep some; they load exactly and the engine casts them as it casts the rest). A weight stored
    narrower than the checkpoint's dtype is an error: its lost bits cannot come back."""
    present = {name for name in headers if not unchecked_tensor(config, name)}
    has_mtp = any(name.startswith(MTP_PREFIX) for name in headers)
    expected = expected_tensors(config, include_mtp=has_mtp)
    missing = sorted(set(expected) - present)
    if has_mtp and missing and all(name.startswith(MTP_PREFIX) for name in missing):
        n_mtp = sum(name.startswith(MTP_PREFIX) for name in expected)
        raise CheckpointError(f"partial MTP set: {n_mtp - len(missing)} of {n_mtp} mtp.* tensors present, "
                              f"missing {_some(missing)}")
    if missing:
        raise CheckpointError(f"missing tensor {_some(missing)}")
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {_some(unexpected)}")
    weight_dtype = weight_dtype_name(config)
    wider = []
    for name in sorted(expected):
        spec = expected[name]
        path, dtype, shape = headers[name]
        if shape != spec.shape:
            raise CheckpointError(f"{name}: shape {shape} does not match config {spec.shape}")
        if spec.kind in FIXED_DTYPES:
            want = FIXED_DTYPES[spec.kind]
            if dtype not in want:
                raise CheckpointError(f"{name}: dtype {dtype}, expected {' or '.join(want)}")
        elif weight_dtype is None:  # config.json declares none: the first weight sets it
            if dtype not in ("float32", "bfloat16"):
                raise CheckpointError(f"{name}: dtype {dtype}, expected float32 or bfloat16")
            weight_dtype = dtype
        elif (dtype, weight_dtype) == ("float32", "bfloat16"):
            wider.append(name)
        elif dtype != weight_dtype:
            raise CheckpointError(f"{name}: dtype {dtype} does not match checkpoint dtype {weight_dtype}")
    return has_mtp, weight_dtype or "float32", wider


def _check_routing_tables(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if name.endswith("ffn.gate.tid2eid") and tensor.numel():
            lo, hi = int(tensor.min()), int(tensor.max())
            if lo < 0 or hi >= config.n_routed_experts:
                bad = lo if lo < 0 else hi
                raise CheckpointError(f"{name}: expert id {bad} out of range [0, {config.n_routed_experts})")


def _existing(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    return folder


def _tokenizer(folder: Path) -> Path | None:
    path = folder / "tokenizer.json"
    return path if path.is_file() else None


def _some(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
