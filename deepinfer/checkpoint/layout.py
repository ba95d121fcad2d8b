"""The checkpoint's tensor inventory: every name, shape and storage kind, derived from the config.

This is the one source of truth for the writer, the loader and the model: names are what
`DeepseekV4ForCausalLM.save_pretrained` writes, plus our `mtp.{k}.` draft blocks.
"""

from __future__ import annotations

from dataclasses import replace

from deepinfer.checkpoint.errors import CheckpointError
from deepinfer.families.tensor_spec import INDEX, MTP_PREFIX, TensorSpec
from deepinfer.families.v4.config import ModelConfig
from deepinfer.families.v41.config import V41Config
from deepinfer.families.registry import family_of


def expected_tensors(config: ModelConfig | V41Config, include_mtp: bool) -> dict[str, TensorSpec]:
    """Every tensor the engine loads, quantized ones as the config's `quantization_config` stores them;
    `include_mtp` adds the draft layers (V4: our MTP blocks; V4.1: the released DSpark layers, which
    the backbone leaves unused, see `unused_tensor`)."""
    return family_of(config).expected_tensors(config, include_mtp)


def unchecked_tensor(config: ModelConfig | V41Config, name: str) -> bool:
    """A tensor a checkpoint may hold that the layout does not describe (V4.1: the vision tower and the
    routers' image-token biases; the draft layers are checked when present); V4 has none."""
    return family_of(config).unchecked_tensor(config, name)


def unused_tensor(config: ModelConfig | V41Config, name: str) -> bool:
    """A tensor a checkpoint may hold that the engine leaves unused (V4.1: the draft layers, the vision
    tower, the routers' image-token biases); V4 has none."""
    return family_of(config).unused_tensor(config, name)


def weight_dtype_name(config: ModelConfig | V41Config) -> str | None:
    """The storage dtype of "weight" tensors that config.json declares (`dtype`), if it does."""
    name = config.extra.get("dtype")
    if name is None:
        return None
    if name not in ("float32", "bfloat16"):
        raise CheckpointError(f"config.json: field 'dtype' must be 'float32' or 'bfloat16', got {name!r}")
    return name


PARAMETER_GROUPS = ("embedding + head", "attention", "routed experts", "shared experts + routers",
                    "engram memory", "norms + hyper-connections", "mtp draft")


def parameter_group(name: str) -> str:
    if name.startswith(MTP_PREFIX):
        return "mtp draft"
    if name in ("model.embed_tokens.weight", "embed.weight", "head.weight"):
        return "embedding + head"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".engram." in name:
        return "engram memory"
    if ".ffn." in name:
        return "shared experts + routers"
    if ".attn." in name and not name.endswith("norm.weight"):
        return "attention"
    return "norms + hyper-connections"


def parameter_counts(config: ModelConfig | V41Config, include_mtp: bool) -> dict[str, int]:
    """Element counts per `PARAMETER_GROUPS` entry (groups with no tensors are left out); a quantized
    checkpoint counts its weights' logical elements (not packed bytes, not scales)."""
    if config.quantization_config is not None:
        config = replace(config, quantization_config=None)
    counts: dict[str, int] = {}
    for name, spec in expected_tensors(config, include_mtp).items():
        if spec.kind == INDEX:  # routing tables are lookups, not parameters
            continue
        group = parameter_group(name)
        counts[group] = counts.get(group, 0) + spec.numel
    return {g: counts[g] for g in PARAMETER_GROUPS if g in counts}
