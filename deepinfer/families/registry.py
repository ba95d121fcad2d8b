"""The model families the engine runs, keyed by config.json's `model_type`: DeepSeek-V4
(`deepseek_v4`, `families/v4.py`) and V4.1 (`deepseek_v41`, `families/v41.py`); `register_family`
adds another. Code outside the families asks a config's family (`family_of`) what to do with it.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.families.v4.config import ConfigError
from deepinfer.families.base import Family
from deepinfer.families.v4.family import V4
from deepinfer.families.v41.family import V41

FAMILIES: dict[str, Family] = {}
DEFAULT_MODEL_TYPE = "deepseek_v4"  # a config.json that names none (transformers' early V4 files)


def register_family(family: Family) -> None:
    """Make `family` serve configs of its `model_type` (one family per type)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family


def family_of(config) -> Family:
    """The family of a config one of the registered families parsed."""
    family = FAMILIES.get(config.model_type)
    if family is None or not isinstance(config, family.config_class):
        raise ConfigError(f"no registered model family parses {type(config).__name__} configs "
                          f"of model_type {config.model_type!r}")
    return family


def drafting_family(speculation: str) -> Family:
    """The family whose draft model `speculation` runs (`mtp`: V4's MTP block, `dspark`: V4.1's layers)."""
    family = next((f for f in FAMILIES.values() if f.speculation == speculation), None)
    if family is None:
        raise ConfigError(f"no registered model family drafts with speculation={speculation!r}")
    return family


def build_model(config, ops, dtype, device="meta", cache_qdq: bool = True, engram_on_host: bool = False):
    """The model `config` describes, as its family builds it (see `Family.build_model`)."""
    return family_of(config).build_model(config, ops, dtype, device, cache_qdq=cache_qdq,
                                         engram_on_host=engram_on_host)


def load_config(folder: str | Path):
    """Read and validate `folder/config.json` as its `model_type`'s family parses it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (is '{folder}' a DeepSeek-V4 checkpoint folder?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON ({err.msg} at line {err.lineno})") from None
    model_type = raw.get("model_type", DEFAULT_MODEL_TYPE) if isinstance(raw, dict) else DEFAULT_MODEL_TYPE
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"{path}: model_type is {model_type!r}, expected one of {', '.join(map(repr, FAMILIES))}")
    return family.config_class.from_dict(raw, source=str(path))


register_family(V4())
register_family(V41())
