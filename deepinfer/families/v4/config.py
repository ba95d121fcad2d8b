"""Model configuration: `config.json` in the exact `DeepseekV4Config` field layout, validated.

Every field the engine reads must be present with the right type; the error names the file and
the field, so a hand-edited or foreign config fails at load time rather than deep in a forward pass.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field

import torch

from deepinfer.errors import DeepInferError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
# transformers' FineGrainedFP8Config (quant_method "fp8"): the values we load, and the defaults it gives
# the fields a config.json leaves out
QUANT_CHOICES = {"quant_method": ("fp8",), "activation_scheme": ("dynamic",), "scale_fmt": ("float", "ue8m0"),
                 "expert_dtype": ("fp8", "fp4")}
QUANT_DEFAULTS = {"activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "float",
                  "expert_dtype": "fp8"}


class ConfigError(DeepInferError, ValueError):
    """A config.json that the engine cannot run."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    max_position_embeddings: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    partial_rotary_factor: float
    rms_norm_eps: float
    rope_parameters: dict[str, dict]
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    model_type: str = "deepseek_v4"
    quantization_config: dict | None = None
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def rope_head_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def compress_rate(self, layer_type: str) -> int:
        return self.compress_rates[layer_type] if layer_type != SLIDING else 0

    def quantization(self, key: str) -> str | list[int] | None:
        """Field `key` of `quantization_config`, or FineGrainedFP8Config's default (None if it has none)
        when the field is left out."""
        return self.quantization_config.get(key, QUANT_DEFAULTS.get(key))

    def to_dict(self) -> dict:
        """The `config.json` content, field for field as `DeepseekV4Config` writes it."""
        out = asdict(self)
        extra = out.pop("extra")
        if out["quantization_config"] is None:  # as transformers writes an unquantized config
            del out["quantization_config"]
        out["qk_rope_head_dim"] = self.rope_head_dim
        return {**extra, **out}

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"{source}: model_type is {raw['model_type']!r}, expected 'deepseek_v4' or 'deepseek_v41'")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        values = {}
        for name, f in cls.__dataclass_fields__.items():
            if name == "extra":
                continue
            if name not in raw:
                if is_required(f):
                    raise ConfigError(f"{source}: required field '{name}' is missing")
                continue
            values[name] = check_field(source, name, raw[name], _FIELD_TYPES[name])
        extra = {k: v for k, v in raw.items() if k not in known and k != "qk_rope_head_dim"}
        config = cls(**values, extra=extra)
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(f"{source}: {msg}")

        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "num_experts_per_tok",
                     "n_routed_experts", "hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups",
                     "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                fail(f"field '{name}' must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads != 1:
            fail(f"field 'num_key_value_heads' must be 1 (shared-KV MQA), got {self.num_key_value_heads}")
        if self.n_shared_experts != 1:
            fail(f"field 'n_shared_experts' must be 1, got {self.n_shared_experts}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("field 'num_experts_per_tok' exceeds 'n_routed_experts'")
        if self.scoring_func not in SCORING_FUNCS:
            fail(f"field 'scoring_func' must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.hidden_act != "silu":
            fail(f"field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(types) != self.num_hidden_layers:
                fail(f"field '{name}' has {len(types)} entries, expected num_hidden_layers={self.num_hidden_layers}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                fail(f"field '{name}' has unknown entries {bad}; allowed: {list(allowed)}")
        for layer_type in (CSA, HCA):
            if layer_type in self.layer_types:
                rate = self.compress_rates.get(layer_type)
                if not isinstance(rate, int) or rate <= 0:
                    fail(f"field 'compress_rates' needs a positive integer for '{layer_type}'")
        rope = self.rope_head_dim
        if rope <= 0 or rope % 2 or rope > self.head_dim:
            fail(f"field 'partial_rotary_factor' gives rope dim {rope}; it must be even and in (0, head_dim]")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            fail("field 'o_groups' must divide num_attention_heads * head_dim")
        for label in ("main", "compress"):
            params = self.rope_parameters.get(label)
            if not isinstance(params, dict):
                fail(f"field 'rope_parameters' needs a '{label}' object")
            rope_type = params.get("rope_type", "default")
            if rope_type not in ("default", "yarn"):
                fail(f"rope_parameters.{label}.rope_type {rope_type!r} is not supported (default, yarn)")
            if not isinstance(params.get("rope_theta"), (int, float)):
                fail(f"rope_parameters.{label}.rope_theta must be a number")
            if rope_type == "yarn":
                for key in ("factor", "original_max_position_embeddings"):
                    if not isinstance(params.get(key), (int, float)):
                        fail(f"rope_parameters.{label}.{key} must be a number for yarn")
        if self.tie_word_embeddings:
            fail("field 'tie_word_embeddings' must be false for DeepSeek-V4")
        if self.quantization_config is not None:
            self._validate_quantization(source, fail)

    def _validate_quantization(self, source: str, fail) -> None:
        """The FP8 format we decode (`checkpoint.quantized_v4`); anything else would change which tensors
        a checkpoint holds, or how they decode."""
        for key, allowed in QUANT_CHOICES.items():
            if self.quantization(key) not in allowed:
                fail(f"field 'quantization_config.{key}' must be one of {list(allowed)}, got {self.quantization(key)!r}")
        block = check_field(source, "quantization_config.weight_block_size", self.quantization("weight_block_size"),
                            "list[int]")
        if len(block) != 2 or min(block) <= 0:
            fail(f"field 'quantization_config.weight_block_size' must be two positive integers, got {block}")
        for key in ("modules_to_not_convert", "modules_to_convert"):
            if self.quantization(key):
                fail(f"field 'quantization_config.{key}' is not supported: V4 quantizes a fixed set of weights")
        if self.quantization("expert_dtype") == "fp4":
            if self.quantization("scale_fmt") != "ue8m0":
                fail("field 'quantization_config.expert_dtype' 'fp4' needs scale_fmt 'ue8m0' (MXFP4 scales are E8M0)")
            if self.hidden_size % 2 or self.moe_intermediate_size % 2:
                fail("field 'quantization_config.expert_dtype' 'fp4' packs value pairs: hidden_size and "
                     "moe_intermediate_size must be even")

    def rope_inv_freq(self, label: str) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (one per interleaved pair) and cos/sin scale for rope type `label`.

        `main` serves sliding-only layers; `compress` serves CSA/HCA layers, their compressors and
        the indexer. YaRN follows the public V4 reference (attention factor pinned by the config).
        """
        params = self.rope_parameters[label]
        base = float(params["rope_theta"])
        dim = self.rope_head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        pos_freqs = base ** exponents
        if params.get("rope_type", "default") != "yarn":
            return 1.0 / pos_freqs, 1.0
        factor = float(params["factor"])
        original = float(params["original_max_position_embeddings"])
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention_factor)


def is_required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


_INT, _FLOAT, _BOOL, _STR = "int", "float", "bool", "str"
_FIELD_TYPES = {
    "vocab_size": _INT, "hidden_size": _INT, "moe_intermediate_size": _INT, "num_hidden_layers": _INT,
    "num_attention_heads": _INT, "num_key_value_heads": _INT, "head_dim": _INT, "q_lora_rank": _INT,
    "num_experts_per_tok": _INT, "n_routed_experts": _INT, "n_shared_experts": _INT,
    "scoring_func": _STR, "norm_topk_prob": _BOOL, "routed_scaling_factor": _FLOAT,
    "max_position_embeddings": _INT, "layer_types": "list[str]", "mlp_layer_types": "list[str]",
    "compress_rates": "dict", "hc_mult": _INT, "hc_sinkhorn_iters": _INT, "hc_eps": _FLOAT,
    "swiglu_limit": _FLOAT, "sliding_window": _INT, "o_groups": _INT, "o_lora_rank": _INT,
    "index_n_heads": _INT, "index_head_dim": _INT, "index_topk": _INT,
    "num_nextn_predict_layers": _INT, "partial_rotary_factor": _FLOAT, "rms_norm_eps": _FLOAT,
    "rope_parameters": "dict", "rope_theta": _FLOAT, "compress_rope_theta": _FLOAT,
    "bos_token_id": "int|null", "eos_token_id": "int|list[int]|null", "hidden_act": _STR,
    "tie_word_embeddings": _BOOL, "model_type": _STR, "quantization_config": "dict",
}


def check_field(source: str, name: str, value, expected: str):
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    ok = {
        _INT: lambda v: is_int(v),
        _FLOAT: lambda v: is_int(v) or isinstance(v, float),
        _BOOL: lambda v: isinstance(v, bool),
        _STR: lambda v: isinstance(v, str),
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "list[int]": lambda v: isinstance(v, list) and all(is_int(x) for x in v),
        "dict": lambda v: isinstance(v, dict),
        "int|null": lambda v: v is None or is_int(v),
        "int|list[int]|null": lambda v: v is None or is_int(v) or (isinstance(v, list) and all(is_int(x) for x in v)),
    }[expected](value)
    if not ok:
        raise ConfigError(f"{source}: field '{name}' must be {expected}, got {type(value).__name__} {value!r}")
    if expected == _FLOAT:
        return float(value)
    return value
