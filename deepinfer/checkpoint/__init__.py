"""Checkpoint folders: layout, synthetic presets, random weights, writing, loading, content hash."""

from deepinfer.checkpoint.errors import CheckpointError
from deepinfer.checkpoint.hashing import content_hash
from deepinfer.checkpoint.layout import expected_tensors, parameter_counts
from deepinfer.families.tensor_spec import TensorSpec
from deepinfer.checkpoint.loader import (
    Checkpoint, CheckpointInfo, checkpoint_config, inspect_checkpoint, load_checkpoint, load_draft_tensors,
    load_mtp_tensors,
)
from deepinfer.checkpoint.presets import CONFIG_ONLY_PRESETS, PRESETS, preset_config
from deepinfer.checkpoint.random_init import random_tensors
from deepinfer.checkpoint.writer import DEFAULT_PRESET, MODEL_HELP, create_checkpoint, default_checkpoint, write_weights

__all__ = [
    "CONFIG_ONLY_PRESETS", "DEFAULT_PRESET", "MODEL_HELP", "PRESETS", "Checkpoint", "CheckpointError",
    "CheckpointInfo", "TensorSpec",
    "checkpoint_config", "content_hash", "create_checkpoint", "default_checkpoint", "expected_tensors", "inspect_checkpoint",
    "load_checkpoint", "load_draft_tensors", "load_mtp_tensors", "parameter_counts", "preset_config", "random_tensors", "write_weights",
]
