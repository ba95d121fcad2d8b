"""Writing checkpoints: weight shards, synthetic presets, and the embedded default checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.checkpoint.errors import CheckpointError
from deepinfer.checkpoint.files import INDEX_NAME, WeightReader, deepinfer_home, read_headers, weight_files
from deepinfer.checkpoint.hashing import TensorHasher, content_hash, store_hash
from deepinfer.checkpoint.layout import expected_tensors, weight_dtype_name
from deepinfer.families.registry import family_of
from deepinfer.checkpoint.presets import CONFIG_ONLY_PRESETS, preset_config
from deepinfer.checkpoint.random_init import stored_random_tensors
from deepinfer.progress import Progress
from deepinfer.recipe.tokenizer import preset_tokenizer

SHARD_BYTES = 2 * 1024**3
DEFAULT_PRESET = "v41-tiny"  # the embedded default: the target family, stored in the release's formats
MODEL_HELP = f"checkpoint folder (default: the embedded {DEFAULT_PRESET} checkpoint, quantized as released)"


def write_weights(folder: Path, tensors: Mapping[str, torch.Tensor], max_shard_bytes: int = SHARD_BYTES,
                  progress: Progress | None = None) -> str:
    """Write `tensors` in sorted-name order as `model.safetensors`, or as numbered shards plus
    `model.safetensors.index.json` past `max_shard_bytes`; returns their content hash.

    Tensors are fetched one at a time, so a lazy mapping never has more than a shard in memory;
    `progress` counts each one once it is generated and hashed.
    """
    hasher = TensorHasher()
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = folder / f".shard-{len(parts)}.partial"
        save_file(shard, str(path), metadata={"format": "pt"})
        parts.append((path, list(shard)))
        shard.clear()

    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        hasher.add(name, tensor)
        shard[name] = tensor
        size += nbytes
        total += nbytes
        if progress is not None:
            progress.update(1)
    if shard or not parts:
        flush()
    if len(parts) == 1:
        parts[0][0].rename(folder / "model.safetensors")
    else:
        weight_map = {}
        for i, (path, names) in enumerate(parts):
            final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            path.rename(folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return hasher.hexdigest()


def replace_tensors(folder: str | Path, tensors: Mapping[str, torch.Tensor]) -> str:
    """Rewrite the checkpoint in `folder` with `tensors` in place of its stored tensors of the same
    names, shapes and dtypes; every other tensor keeps its bytes. Returns the new content hash.

    Each weight file holding one of them is written whole beside itself first (a hidden `.partial`
    name, which `weight_files` never lists) and renamed over the original only once all are written:
    an interruption before the renames leaves the checkpoint as it was, one between two renames
    (several shards) leaves every file complete, so the checkpoint loads either way."""
    folder = Path(folder)
    files = weight_files(folder)
    headers = read_headers(files)
    for name, tensor in tensors.items():
        if name not in headers:
            raise CheckpointError(f"{folder}: has no tensor {name} to replace")
        _, dtype, shape = headers[name]
        new = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        if new != (dtype, shape):
            raise CheckpointError(f"{name}: stored as {dtype} {shape}, cannot replace it with {new[0]} {new[1]}")
    written: dict[Path, Path] = {}
    try:
        for path in sorted({headers[name][0] for name in tensors}):
            with WeightReader([path]) as reader:
                stored = {name: reader.get(name) for name in reader.headers}
            stored.update({name: tensors[name].detach().to("cpu").contiguous() for name in stored if name in tensors})
            written[path] = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
            save_file(stored, str(written[path]), metadata={"format": "pt"})
        for path, partial in written.items():
            os.replace(partial, path)
    finally:
        for partial in written.values():
            partial.unlink(missing_ok=True)
    return content_hash(folder, trust_cache=False)


def create_checkpoint(preset: str, out: str | Path, seed: int, *, device: str | torch.device = "cpu",
                      max_shard_bytes: int = SHARD_BYTES, progress: bool = False, quantized: bool = False) -> Path:
    """Write a seeded random checkpoint of `preset` to the new folder `out`; `quantized` (V4.1 presets)
    stores it as the release does (FP8 dense weights, MXFP4 experts, FP8 Engram tables).

    Everything goes to a hidden sibling folder first, renamed to `out` only when complete, so an
    interrupted run never leaves a partial checkpoint. Config-only presets get no weights. With
    `progress`, the tensors written so far show on stderr (deepinfer.progress: a bar on a terminal,
    a status line every 10 s when piped).
    """
    config = preset_config(preset)
    if quantized:
        family = family_of(config)
        config = family.released_format(config)
        if config is None:
            raise CheckpointError(f"--quantized writes a family's released formats; preset {preset!r} is a "
                                  f"{family.name} model, which has none")
    out = Path(out)
    _refuse_existing(out)
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:  # e.g. cuda asked for on a CPU-only build
        raise CheckpointError(f"device {str(device)!r} is not usable here ({str(err).splitlines()[0]})") from None
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointError(f"{out}: cannot create folder ({err.strerror or err})") from None
    try:
        digest = None
        if preset not in CONFIG_ONLY_PRESETS:
            dtype = getattr(torch, weight_dtype_name(config) or "float32")
            tensors = stored_random_tensors(config, seed, dtype, device)
            with Progress(f"checkpoint {preset}", len(tensors), enabled=progress, unit="tensors") as bar:
                digest = write_weights(tmp, tensors, max_shard_bytes, progress=bar)
        preset_tokenizer(family_of(config).encoding, config.vocab_size).save(tmp)
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
        os.rename(tmp, out)  # atomic; also succeeds onto an empty folder
        if digest is not None:
            store_hash(weight_files(out), digest)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            _refuse_existing(out)  # lost a race against another writer of `out`
            raise CheckpointError(f"{out}: cannot write checkpoint ({err.strerror or err})") from None
        raise
    return out


def default_checkpoint_path() -> Path:
    """Where the embedded default lives (it may not exist yet): named by a digest of its config, of the
    tensors the writer writes for it and of its tokenizer, so a default built before its layout or its
    tokenizer changed (before its draft layers were written, say) is not taken for the current one."""
    preset = preset_config(DEFAULT_PRESET)
    family = family_of(preset)
    config = family.released_format(preset)
    key = json.dumps({"config": config.to_dict(), "tensors": sorted(expected_tensors(config, include_mtp=True)),
                      "tokenizer": preset_tokenizer(family.encoding, config.vocab_size).content_hash}, sort_keys=True)
    return deepinfer_home() / f"{DEFAULT_PRESET}-seed0-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def default_checkpoint() -> Path:
    """The embedded default: the `DEFAULT_PRESET` preset in the release's formats (FP8 dense weights,
    MXFP4 experts), seed 0, created once under `$DEEPINFER_HOME`.

    The folder name carries a digest of the preset's config and layout (`default_checkpoint_path`), so a
    release that changes either builds a fresh default instead of reusing a stale one. Concurrent first calls each build a
    private copy; the first rename wins and the others use it.
    """
    target = default_checkpoint_path()
    if not (target / "config.json").is_file():
        try:
            create_checkpoint(DEFAULT_PRESET, target, seed=0, quantized=True)
        except CheckpointError:
            if not (target / "config.json").is_file():
                raise
    return target


def _refuse_existing(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise CheckpointError(f"{out}: already exists and is not an empty folder; refusing to overwrite")
