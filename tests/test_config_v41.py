"""DeepSeek-V4.1's nested config.json (deepinfer/families/v41/config.py): parsing, layer roles, validation.

The layer schedule rules are checked against NeMo AutoModel's `DeepseekV41TextConfig` (the oracle
package of the dev install): over random schedules, ours rejects exactly what NeMo rejects.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.families.v41.presets import V41_PRESETS, v41_preset_config
from deepinfer.families.v4.config import ConfigError
from deepinfer.families.registry import load_config
from deepinfer.families.v41.config import FULL, REINDEX, REUSE, SWA, V41Config

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def flash_text() -> dict:
    """The Flash text config's fields, with the values V41.md §2 lists."""
    return {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "attention_bias": False, "max_position_embeddings": 1048576,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
        "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
    }


def flash_raw() -> dict:
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "image_token_id": 129264, "text_config": flash_text(),
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    }


def test_flash_layer_roles():
    roles = V41Config.from_dict(flash_raw()).roles
    assert len(roles) == 40
    kinds = {layer: (role.kind, role.ratio) for layer, role in enumerate(roles)}
    assert [kinds[i] for i in (0, 1)] == [(SWA, 0)] * 2
    assert all(kinds[i] == (FULL, 2) for i in (2, 8, 14)) and kinds[20] == (FULL, 1)
    assert all(kinds[i] == (REINDEX, 1) for i in (24, 28, 32, 36))
    reuse = set(range(3, 8)) | set(range(9, 14)) | set(range(15, 20)) | (set(range(21, 40)) - {24, 28, 32, 36})
    assert {i for i, (kind, _) in kinds.items() if kind == REUSE} == reuse
    # consumers read the most recent source at or below them
    assert (roles[5].kv_source, roles[5].index_source) == (2, 2)
    assert (roles[19].kv_source, roles[19].index_source) == (14, 14)
    assert (roles[27].kv_source, roles[27].index_source) == (20, 24)
    assert (roles[39].kv_source, roles[39].index_source) == (20, 36)
    assert [i for i, r in enumerate(roles) if r.candidate_source] == [20]
    assert [i for i, r in enumerate(roles) if r.uses_candidates] == [24, 28, 32, 36]
    assert [i for i, r in enumerate(roles) if r.engram] == [1, 14]


def test_the_released_layout_round_trips():
    raw = flash_raw()
    raw["text_config"]["some_future_field"] = [1, 2]
    config = V41Config.from_dict(copy.deepcopy(raw))
    assert config.to_dict() == raw
    assert V41Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def broken(path: str, value) -> dict:
    raw = flash_raw()
    *parents, last = path.split(".")
    target = raw
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return raw


@pytest.mark.parametrize(("path", "value", "message"), [
    ("model_type", "deepseek_v4", "model_type is 'deepseek_v4', expected 'deepseek_v41'"),
    ("text_config", [], "field 'text_config' must be an object"),
    ("text_config.index_topk", KeyError, "required field 'text_config.index_topk' is missing"),
    ("text_config.hidden_size", "5120", "field 'text_config.hidden_size' must be int, got str '5120'"),
    ("text_config.compress_ratios", [0, 0, 2], "field 'text_config.compress_ratios' has 3 entries; it must cover "
                                               "the 40 layers and 3 draft layers"),
    ("text_config.kv_source_layer_ids", [2, 8, 14, 21], "every layer in 'text_config.kv_source_layer_ids' must "
                                                         "also be in 'index_source_layer_ids'"),
    ("text_config.candidate_source_layer_id", 24, "field 'text_config.candidate_source_layer_id' must be -1 or a "
                                                  "layer in 'kv_source_layer_ids'"),
    ("text_config.engram_num_embeddings", [5], "field 'text_config.engram_num_embeddings' needs one row count per "
                                               "entry of 'engram_layer_ids'"),
    ("text_config.rms_norm_eps", 0, "field 'text_config.rms_norm_eps' must be finite and positive, got 0.0"),
])
def test_bad_configs_fail_in_one_line_naming_the_field(path, value, message):
    with pytest.raises(ConfigError) as err:
        V41Config.from_dict(broken(path, value), source="model/config.json")
    assert str(err.value) == f"model/config.json: {message}"


def nemo_accepts(text: dict) -> bool:
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    fields = {k: v for k, v in text.items() if k != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers on the release's `rope_scaling` name
        try:
            DeepseekV41TextConfig(**fields)
        except ValueError:
            return False
    return True


@st.composite
def schedules(draw) -> dict:
    layers = draw(st.integers(2, 8))
    ratios = draw(st.lists(st.sampled_from([0, 1, 2]), min_size=layers, max_size=layers))
    compressed = [i for i, r in enumerate(ratios) if r]
    kv = sorted(draw(st.sets(st.sampled_from(compressed), max_size=3))) if compressed else []
    index = sorted(set(kv) | draw(st.sets(st.integers(0, layers - 1), max_size=2)))
    candidate = draw(st.sampled_from([-1] + kv + [layers - 1]))
    text = flash_text()
    text.update(num_hidden_layers=layers, compress_ratios=ratios + [0, 0, 0], kv_source_layer_ids=kv,
                index_source_layer_ids=index, candidate_source_layer_id=candidate,
                engram_layer_ids=[], engram_num_embeddings=[], dspark_target_layer_ids=[])
    return text


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_schedules_are_accepted_exactly_when_nemo_accepts_them(text):
    raw = {"model_type": "deepseek_v41", "text_config": text}
    try:
        V41Config.from_dict(raw)
        ours = True
    except ConfigError:
        ours = False
    assert ours == nemo_accepts(text)


def test_the_ep8_rank_preset_is_flash_with_a_ranks_experts() -> None:
    """`v41-flash-ep8-rank` (one rank's compute under EP 8, measured on one GPU) is the release's shape but
    for its routed experts (an eighth) and its Engram tables (smaller, the same gathers per token)."""
    flash, rank = v41_preset_config("v41-flash"), v41_preset_config("v41-flash-ep8-rank")
    differ = {f.name for f in dataclasses.fields(flash) if getattr(flash, f.name) != getattr(rank, f.name)}
    assert differ == {"n_routed_experts", "engram_vocab_size", "engram_num_embeddings"}
    assert rank.n_routed_experts * 8 == flash.n_routed_experts and rank.num_hidden_layers == 40


@pytest.mark.parametrize("preset", V41_PRESETS)
def test_presets_round_trip_and_nemo_accepts_them(tmp_path, preset):
    config = v41_preset_config(preset)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert load_config(tmp_path) == config
    assert nemo_accepts(config.to_dict()["text_config"])
