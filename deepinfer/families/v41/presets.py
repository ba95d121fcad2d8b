"""DeepSeek-V4.1 model shapes for synthetic checkpoints, in the released `config.json` layout.

`v41-tiny` and `v41-small` are for CPU work; `v41-flash-5l` has Flash's widths in five layers (an
H200 holds it in the release's formats, ~40 GiB; decoded to bf16 it would not fit); `v41-flash` is
the release's shape, config only; `v41-flash-ep8-rank` is what one rank of expert parallelism over 8
computes of it: every layer, attention and shared experts whole, the 48 routed experts a rank holds
(routed among themselves, so a step's tokens give the rank the slots it gets at a balanced load), and
Engram tables of `v41-flash-5l`'s size (a step gathers the same rows from a smaller table). The Flash-width presets declare the release's quantization, the
small ones are plain unless written with `--quantized`.

Each preset below Flash size has every CSA2 role (window-only, Full at ratio 2 and a Reuse after it, Full at
ratio 1 that picks the candidate pool, Reuse at ratio 1, Reindex in the pool) and Engram at two
layers. Engram's compressed vocabulary and table sizes follow from the preset's tokenizer (the
same one `checkpoint create` writes), so the config always agrees with it.
"""

from __future__ import annotations

import functools

from deepinfer.families.v41.layout import QUANTIZATION
from deepinfer.families.v41.config import MODEL_TYPE, TEXT_MODEL_TYPE, V41Config
from deepinfer.families.v41.engram import engram_layouts, vocabulary_map
from deepinfer.recipe.tokenizer import BOS, EOS, PAD, V4_VOCAB_SIZE, preset_tokenizer

V41_PRESETS = ("v41-tiny", "v41-small", "v41-flash-5l", "v41-flash", "v41-flash-ep8-rank")
V41_CONFIG_ONLY = ("v41-flash",)
RELEASE_NOISE_TOKEN_ID = 128799  # the release's DSpark mask token, a placeholder of V4's vocabulary (V41 notes, section 2)
# every role in six layers; the three draft layers (not built yet) are window-only
_ROLE_SCHEDULE = dict(compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[1, 3],
                      index_source_layer_ids=[1, 3, 5], candidate_source_layer_id=3, engram_layer_ids=[0, 4],
                      num_hidden_layers=6, num_nextn_predict_layers=3, dspark_target_layer_ids=[3, 4, 5])
_COMMON = dict(
    num_key_value_heads=1, n_shared_experts=1, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, hidden_act="silu", attention_bias=False,
    tie_word_embeddings=False, dspark_block_size=5, dspark_markov_rank=16, engram_max_ngram_size=3,
)


# the release's widths (V41 notes, section 2); Flash-width presets are stored as the release stores them
_FLASH_WIDTHS = dict(
    dtype="bfloat16", vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_attention_heads=64,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8, n_routed_experts=384,
    num_experts_per_tok=6, sliding_window=128, rms_norm_eps=1e-20, max_position_embeddings=1048576,
    yarn_original=65536, index_n_heads=32, index_head_dim=128, index_topk=512, candidate_topk_blocks=2048,
    candidate_block_size=8, engram_n_heads=8, engram_head_dim=256, engram_max_ngram_size=4,
    dspark_n_routed_experts=128, dspark_num_experts_per_tok=3, dspark_markov_rank=256, quantized=True,
)
# the release's 40 layers (V41 notes, section 2)
_FLASH_SCHEDULE = dict(
    num_hidden_layers=40, num_nextn_predict_layers=3, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source_layer_id=20, engram_layer_ids=[1, 14], dspark_target_layer_ids=[37, 38, 39],
)


def v41_preset_config(name: str) -> V41Config:
    shapes = {
        "v41-tiny": dict(
            dtype="float32", vocab_size=1024, hidden_size=128, moe_intermediate_size=64, num_attention_heads=4,
            head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2, n_routed_experts=16,
            num_experts_per_tok=2, sliding_window=32, rms_norm_eps=1e-6, max_position_embeddings=4096,
            yarn_original=256, index_n_heads=16, index_head_dim=32, index_topk=16, candidate_topk_blocks=4,
            candidate_block_size=4, engram_n_heads=2, engram_head_dim=16, engram_vocab_size=1009,
            dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, **_ROLE_SCHEDULE),
        "v41-small": dict(
            dtype="float32", vocab_size=8192, hidden_size=512, moe_intermediate_size=256, num_attention_heads=8,
            head_dim=128, qk_rope_head_dim=32, q_lora_rank=256, o_lora_rank=128, o_groups=4, n_routed_experts=32,
            num_experts_per_tok=4, sliding_window=64, rms_norm_eps=1e-6, max_position_embeddings=16384,
            yarn_original=1024, index_n_heads=16, index_head_dim=64, index_topk=64, candidate_topk_blocks=16,
            candidate_block_size=8, engram_n_heads=4, engram_head_dim=64, engram_vocab_size=100003,
            dspark_n_routed_experts=16, dspark_num_experts_per_tok=2, **_ROLE_SCHEDULE),
        "v41-flash-5l": dict(  # Flash widths; every role in five layers; Engram tables 1/80 of Flash's
            **_FLASH_WIDTHS, engram_vocab_size=200003, num_hidden_layers=5, num_nextn_predict_layers=3,
            compress_ratios=[0, 2, 2, 1, 1, 0, 0, 0], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 4],
            candidate_source_layer_id=3, engram_layer_ids=[0, 4], dspark_target_layer_ids=[2, 3, 4]),
        "v41-flash": dict(**_FLASH_WIDTHS, engram_vocab_size=16000000, **_FLASH_SCHEDULE),  # the release's shape
        "v41-flash-ep8-rank": dict(**{**_FLASH_WIDTHS, "n_routed_experts": 384 // 8}, engram_vocab_size=200003,
                                   **_FLASH_SCHEDULE),
    }
    if name not in shapes:
        raise ValueError(f"unknown V4.1 preset {name!r}")
    return _config(**shapes[name])


@functools.cache
def _compressed_vocab_size(vocab_size: int) -> int:
    """Engram's compressed vocabulary under the preset tokenizer (folding V4's takes most of a second)."""
    return vocabulary_map(preset_tokenizer("v41", vocab_size).backend, vocab_size)[1]


def _config(*, dtype: str, yarn_original: int, quantized: bool = False, **fields) -> V41Config:
    text = {**_COMMON, **fields}
    tokenizer = preset_tokenizer("v41", text["vocab_size"])
    compressed = _compressed_vocab_size(text["vocab_size"])
    layouts = engram_layouts(text["engram_layer_ids"], text["engram_max_ngram_size"], text["engram_n_heads"],
                             text["engram_vocab_size"], compressed)
    text.update(
        model_type=TEXT_MODEL_TYPE,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": yarn_original},
        engram_compressed_vocab_size=compressed, engram_num_embeddings=[x.rows for x in layouts],
        engram_pad_token_id=tokenizer.token_to_id(PAD), pad_token_id=tokenizer.token_to_id(PAD),
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(EOS),
        dspark_noise_token_id=RELEASE_NOISE_TOKEN_ID if tokenizer.vocab_size == V4_VOCAB_SIZE else tokenizer.vocab_size - 1,
    )
    raw = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": MODEL_TYPE, "dtype": dtype, "text_config": text}
    if quantized:
        raw["quantization_config"] = dict(QUANTIZATION)
    return V41Config.from_dict(raw, source=f"preset {text['vocab_size']}")
