"""DeepSeek-V4.1 model configuration: the released nested `config.json`, validated, and each layer's role.

The release nests the language model's fields under `text_config` (`model_type`
`deepseek_v41_text`) beside `quantization_config` and `vision_config`. Attention is CSA2: one
compression ratio per layer (`compress_ratios`, which also covers the DSpark draft layers), a few
layers that own a compressor (`kv_source_layer_ids`) or an indexer (`index_source_layer_ids`), and
every other compressed layer reusing the most recent source at or below it (see `LayerRole`).
Every field the engine reads must be present with the right type; errors name the file and field.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch

from deepinfer.families.v4.config import ConfigError, check_field, is_required

MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
SWA, FULL, REUSE, REINDEX = "swa", "full", "reuse", "reindex"


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer's attention does besides its sliding window.

    kind: `swa` (window only), `full` (owns the compressor, the index keys and its own top-k),
    `reindex` (own index queries and top-k over `kv_source`'s keys) or `reuse` (attends to
    `kv_source`'s compressed entries at `index_source`'s top-k). `candidate_source`: this layer also
    picks the candidate pool; `uses_candidates`: its index scores are restricted to that pool.
    """

    kind: str
    ratio: int
    kv_source: int | None = None
    index_source: int | None = None
    candidate_source: bool = False
    uses_candidates: bool = False
    engram: bool = False


DRAFT_ROLE = LayerRole(SWA, 0)  # every DSpark draft layer: sliding window only, no Engram


@dataclass
class V41Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict
    compress_rope_theta: float
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    sliding_window: int
    compress_ratios: list[int]
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: list[int]
    engram_num_embeddings: list[int]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: list[int]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    hidden_act: str = "silu"
    topk_method: str = "noaux_tc"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = 2
    quantization_config: dict | None = None
    text_extra: dict = field(default_factory=dict, repr=False)
    extra: dict = field(default_factory=dict, repr=False)

    model_type = MODEL_TYPE

    @property
    def rope_head_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @property
    def num_draft_layers(self) -> int:
        """How many DSpark draft layers (`mtp.{k}`) the model has: none without target layers to read."""
        return self.num_nextn_predict_layers if self.dspark_target_layer_ids else 0

    @property
    def roles(self) -> list[LayerRole]:
        """One `LayerRole` per backbone layer (the draft layers are not in it)."""
        roles, kv_source, index_source = [], None, None
        candidate = self.candidate_source_layer_id
        for layer in range(self.num_hidden_layers):
            ratio = self.compress_ratios[layer]
            engram = layer in self.engram_layer_ids
            if ratio == 0:
                roles.append(LayerRole(SWA, 0, engram=engram))
                continue
            if layer in self.kv_source_layer_ids:
                kind, kv_source, index_source = FULL, layer, layer
            elif layer in self.index_source_layer_ids:
                kind, index_source = REINDEX, layer
            else:
                kind = REUSE
            indexes = kind != REUSE
            roles.append(LayerRole(
                kind, ratio, kv_source, index_source, candidate_source=layer == candidate,
                uses_candidates=indexes and 0 <= candidate < layer, engram=engram,
            ))
        return roles

    def rope_inv_freq(self, label: str) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (one per interleaved pair of the last `qk_rope_head_dim` channels) and
        the cos/sin scale for `main` (window-only layers: `rope_theta`, unscaled) or `compress`
        (compressed layers, their entries and the indexer: `compress_rope_theta` with YaRN's
        frequency ramp and no magnitude factor). The arithmetic follows the reference's order, so
        the angles agree bit for bit (they feed cache quantizers, where one ulp can flip a code)."""
        dim = self.qk_rope_head_dim
        theta = self.compress_rope_theta if label == "compress" else self.rope_theta
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if label != "compress":
            return freqs, 1.0
        scaling = self.rope_scaling
        original, factor = float(scaling["original_max_position_embeddings"]), float(scaling["factor"])

        def bound(beta: float) -> float:
            return dim * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(bound(float(scaling["beta_fast"]))), 0)
        high = min(math.ceil(bound(float(scaling["beta_slow"]))), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        return freqs / factor * ramp + freqs * (1 - ramp), 1.0

    def to_dict(self) -> dict:
        """The released `config.json` layout (nested `text_config`)."""
        text = asdict(self)
        quantization = text.pop("quantization_config")
        extra, text_extra = text.pop("extra"), text.pop("text_extra")
        top = {**extra, "model_type": MODEL_TYPE, "text_config": {**text_extra, **text, "model_type": TEXT_MODEL_TYPE}}
        if quantization is not None:
            top["quantization_config"] = quantization
        return top

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "V41Config":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"{source}: model_type is {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: field 'text_config' must be an object")
        if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
            raise ConfigError(f"{source}: text_config.model_type is {text['model_type']!r}, expected {TEXT_MODEL_TYPE!r}")
        quantization = raw.get("quantization_config")
        if quantization is not None and not isinstance(quantization, dict):
            raise ConfigError(f"{source}: field 'quantization_config' must be an object")
        values = {}
        for name, f in cls.__dataclass_fields__.items():
            if name in _NOT_TEXT:
                continue
            if name not in text:
                if is_required(f):
                    raise ConfigError(f"{source}: required field 'text_config.{name}' is missing")
                continue
            values[name] = check_field(source, f"text_config.{name}", text[name], _FIELD_TYPES[name])
        text_extra = {k: v for k, v in text.items() if k not in cls.__dataclass_fields__ and k != "model_type"}
        extra = {k: v for k, v in raw.items() if k not in ("model_type", "text_config", "quantization_config")}
        config = cls(**values, quantization_config=quantization, text_extra=text_extra, extra=extra)
        config._validate(source)
        return config

    def _validate(self, source: str) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(f"{source}: {msg}")

        for name in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                     "n_routed_experts", "num_experts_per_tok", "sliding_window", "index_n_heads",
                     "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                fail(f"field 'text_config.{name}' must be positive, got {getattr(self, name)}")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                fail(f"field 'text_config.{name}' must be finite and positive, got {getattr(self, name)}")
        if self.num_key_value_heads != 1:
            fail(f"field 'text_config.num_key_value_heads' must be 1 (shared-KV MQA), got {self.num_key_value_heads}")
        if self.n_shared_experts != 1:
            fail(f"field 'text_config.n_shared_experts' must be 1, got {self.n_shared_experts}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("field 'text_config.num_experts_per_tok' exceeds 'n_routed_experts'")
        if self.scoring_func != "sqrtsoftplus":
            fail(f"field 'text_config.scoring_func' must be 'sqrtsoftplus', got {self.scoring_func!r}")
        if self.hidden_act != "silu":
            fail(f"field 'text_config.hidden_act' must be 'silu', got {self.hidden_act!r}")
        if self.tie_word_embeddings:
            fail("field 'text_config.tie_word_embeddings' must be false for DeepSeek-V4.1")
        rope = self.qk_rope_head_dim
        if rope <= 0 or rope % 2 or rope > min(self.head_dim, self.index_head_dim):
            fail(f"field 'text_config.qk_rope_head_dim' is {rope}; it must be even, positive and at most "
                 "head_dim and index_head_dim")
        if self.num_attention_heads % self.o_groups:
            fail("field 'text_config.o_groups' must divide num_attention_heads")
        if self.rope_scaling.get("rope_type") != "yarn":
            fail("field 'text_config.rope_scaling' must be a yarn scaling (rope_type 'yarn')")
        for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if not isinstance(self.rope_scaling.get(key), (int, float)):
                fail(f"field 'text_config.rope_scaling.{key}' must be a number")
        self._validate_schedule(fail)
        self._validate_engram(fail)

    def _validate_schedule(self, fail) -> None:
        layers = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) < layers:
            fail(f"field 'text_config.compress_ratios' has {len(self.compress_ratios)} entries; it must cover the "
                 f"{self.num_hidden_layers} layers and {self.num_nextn_predict_layers} draft layers")
        if any(ratio < 0 for ratio in self.compress_ratios):
            fail("field 'text_config.compress_ratios' must hold non-negative ratios")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = getattr(self, name)
            if ids != sorted(set(ids)) or any(i < 0 or i >= self.num_hidden_layers for i in ids):
                fail(f"field 'text_config.{name}' must be strictly increasing layer ids below num_hidden_layers")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            fail("every layer in 'text_config.kv_source_layer_ids' must also be in 'index_source_layer_ids'")
        owner_ratio = None
        for layer in range(self.num_hidden_layers):
            ratio = self.compress_ratios[layer]
            if ratio == 0:
                if layer in self.index_source_layer_ids:
                    fail(f"layer {layer} has compress ratio 0 but is listed as a KV or index source")
                continue
            if layer in self.kv_source_layer_ids:
                owner_ratio = ratio
            if owner_ratio != ratio:
                fail(f"compressed layer {layer} (ratio {ratio}) has no KV source at or below it with the same ratio")
        candidate = self.candidate_source_layer_id
        if candidate < -1 or (candidate >= 0 and candidate not in self.kv_source_layer_ids):
            fail("field 'text_config.candidate_source_layer_id' must be -1 or a layer in 'kv_source_layer_ids'")
        if candidate >= 0 and (self.candidate_block_size <= 0 or self.candidate_topk_blocks <= 0):
            fail("fields 'text_config.candidate_block_size' and 'candidate_topk_blocks' must be positive")

    def _validate_engram(self, fail) -> None:
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            fail("field 'text_config.engram_num_embeddings' needs one row count per entry of 'engram_layer_ids'")
        if not self.engram_layer_ids:
            return
        for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
            if getattr(self, name) <= 0:
                fail(f"field 'text_config.{name}' must be positive, got {getattr(self, name)}")
        if min(self.engram_num_embeddings) <= 0:
            fail("field 'text_config.engram_num_embeddings' must hold positive row counts")
        if self.engram_max_ngram_size < 2:
            fail(f"field 'text_config.engram_max_ngram_size' must be at least 2, got {self.engram_max_ngram_size}")
        if not 0 <= self.engram_pad_token_id < self.vocab_size:
            fail(f"field 'text_config.engram_pad_token_id' {self.engram_pad_token_id} is outside the vocabulary")


def draft_config(config: V41Config) -> V41Config:
    """`config` with the DSpark draft layers' expert count and top-k in the fields the MoE reads."""
    return replace(config, n_routed_experts=config.dspark_n_routed_experts,
                   num_experts_per_tok=config.dspark_num_experts_per_tok)


_NOT_TEXT = ("quantization_config", "text_extra", "extra")
_INT, _FLOAT, _BOOL, _STR, _INTS = "int", "float", "bool", "str", "list[int]"
_FIELD_TYPES = {
    **{name: _INT for name in (
        "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
        "max_position_embeddings", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "sliding_window",
        "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id", "candidate_topk_blocks",
        "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "engram_max_ngram_size", "engram_vocab_size",
        "engram_n_heads", "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size",
        "num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank",
        "dspark_n_routed_experts", "dspark_num_experts_per_tok")},
    **{name: _FLOAT for name in (
        "swiglu_limit", "rms_norm_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor", "hc_eps")},
    **{name: _INTS for name in (
        "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
        "engram_num_embeddings", "dspark_target_layer_ids")},
    "rope_scaling": "dict", "scoring_func": _STR, "topk_method": _STR, "hidden_act": _STR, "norm_topk_prob": _BOOL,
    "attention_bias": _BOOL, "tie_word_embeddings": _BOOL, "bos_token_id": "int|null",
    "eos_token_id": "int|list[int]|null", "pad_token_id": "int|null",
}
