"""The model families the engine runs, keyed by config.json's `model_type`: DeepSeek-V4
(`deepseek_v4`: `deepinfer.config.ModelConfig`, transformers' `DeepseekV4Config` layout) and V4.1
(`deepseek_v41`: `deepinfer.config_v41.V41Config`, the release's nested layout). A config is read
through here, so neither config module needs the other.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.config import ConfigError, ModelConfig
from deepinfer.config_v41 import V41Config

CONFIG_CLASSES: dict[str, type[ModelConfig] | type[V41Config]] = {"deepseek_v4": ModelConfig,
                                                                   "deepseek_v41": V41Config}


def load_config(folder: str | Path) -> ModelConfig | V41Config:
    """Read and validate `folder/config.json` as its `model_type`'s config (V4's when it names no
    other family, whose validation then names what is wrong)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (is '{folder}' a DeepSeek-V4 checkpoint folder?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
    family = CONFIG_CLASSES.get(raw.get("model_type") if isinstance(raw, dict) else None, ModelConfig)
    return family.from_dict(raw, source=str(path))
