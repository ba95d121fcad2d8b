import json
from pathlib import Path

import pytest

from deepinfer.checkpoint.presets import PRESETS, preset_config
from deepinfer.families.v41.presets import V41_PRESETS
from deepinfer.families.v4.config import CSA, ConfigError, ModelConfig
from deepinfer.families.registry import load_config


def _write(folder: Path, raw) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder / "config.json"


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_round_trips_through_config_json(tmp_path, preset):
    config = preset_config(preset)
    _write(tmp_path, config.to_dict())
    assert load_config(tmp_path) == config


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in V41_PRESETS])  # V4.1: tests/test_config_v41.py
def test_transformers_reads_every_field_back_equal(tmp_path, preset):
    transformers = pytest.importorskip("transformers")
    raw = preset_config(preset).to_dict()
    _write(tmp_path, raw)
    hf = transformers.DeepseekV4Config.from_pretrained(tmp_path).to_dict()
    assert {k: hf.get(k) for k in raw} == raw


def test_tiny_preset_shape():
    c = preset_config("tiny")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.head_dim, c.rope_head_dim) == (1024, 128, 4, 64, 16)
    assert c.compress_rates[CSA] == 4 and c.extra["dtype"] == "float32"
    assert c.rope_parameters["compress"]["rope_type"] == "yarn"


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{tmp_path / 'config.json'}: not found (is '{tmp_path}' a DeepSeek-V4 checkpoint folder?)"


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 1024,')
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: invalid JSON (")


def test_missing_field(tmp_path):
    raw = preset_config("tiny").to_dict()
    del raw["hidden_size"]
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{path}: required field 'hidden_size' is missing"


@pytest.mark.parametrize("field,value,expected", [
    ("hidden_size", "128", "must be int, got str '128'"),
    ("vocab_size", True, "must be int, got bool True"),
    ("norm_topk_prob", 1, "must be bool, got int 1"),
    ("layer_types", "sliding_attention", "must be list[str], got str 'sliding_attention'"),
])
def test_wrong_type(tmp_path, field, value, expected):
    raw = preset_config("tiny").to_dict()
    raw[field] = value
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{path}: field '{field}' {expected}"


@pytest.mark.parametrize("change,expected", [
    ({"layer_types": ["sliding_attention"] * 3}, "field 'layer_types' has 3 entries, expected num_hidden_layers=4"),
    ({"model_type": "llama"}, "model_type is 'llama', expected one of 'deepseek_v4', 'deepseek_v41'"),
    ({"num_key_value_heads": 2}, "field 'num_key_value_heads' must be 1 (shared-KV MQA), got 2"),
    ({"partial_rotary_factor": 0.3},
     "field 'partial_rotary_factor' gives rope dim 19; it must be even and in (0, head_dim]"),
])
def test_invalid_values(tmp_path, change, expected):
    path = _write(tmp_path, {**preset_config("tiny").to_dict(), **change})
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{path}: {expected}"


def test_unknown_fields_are_kept(tmp_path):
    raw = {**preset_config("tiny").to_dict(), "initializer_range": 0.02}
    _write(tmp_path, raw)
    config = load_config(tmp_path)
    assert config.extra["initializer_range"] == 0.02
    assert ModelConfig.from_dict(config.to_dict()) == config
