"""The V4.1 model (deepinfer/families/v41/model.py, csa2.py, engram.py) against NeMo AutoModel's V4.1
port on CPU in fp32, on three tiny configurations whose union has every CSA2 role, each with the cache
quantize-dequantize of the release on and off, in one-pass prefill, 37-token chunks and token-by-token
decode, and end to end through `LLM` (prompt logprobs and greedy tokens) from the checkpoint NeMo's
state-dict adapters export in the released layout, fp32 and (without the cache QDQ, see that test)
quantized to FP8 / MXFP4.

- A (6 layers, 70-token prompt): window-only, Full ratio 2 with a Reuse after it, Full ratio 1 that
  picks the candidate pool, Reuse ratio 1, Reindex ratio 1 restricted to the pool; Engram (3-grams)
  at the window-only layer and at the Reuse layer.
- B (8 layers, 100-token prompt, window 8, hidden 160, 8 heads of 32, 4 output groups, 12 experts
  top-3, eps 1e-20 as released): two window-only layers, a ratio-1 group (Full, Reindex without a
  pool, a Reuse of the Reindex's top-k), then a ratio-2 group whose Full layer picks the pool (blocks
  of 3) and whose Reindex is restricted to it; Engram (4-grams) at a window-only and the Reindex
  layer; the DSpark draft layers NeMo builds ride along in the checkpoint, unused. (The pool's source
  comes last: NeMo masks every later Full or Reindex layer with the pool, so they need its ratio.)
- C (7 layers, 150-token prompt, hidden 96, 6 heads of 48, index keys of 24, no candidate pool, no
  draft layers, SwiGLU clamped at 0.25): a Full ratio-2 first layer, Reuse and Reindex at ratio 2, a
  window-only layer, then two Full ratio-1 layers in a row and a Reuse; Engram (bigrams) at the Full
  and window-only layers. Widths that are not multiples of the 32-wide (and 16-wide) cache
  quantization groups end in a short group.

NeMo's weights are random, norms, sinks, router biases, mixing and Engram gate weights included; its
adapter exports them into the released names, with its (tiny) vision tower, aligner and image-token
router biases, and our model loads the backbone. Exact ties in the indexer's
top-k (entries whose score is exactly 0 because every head's dot product is negative) are broken
arbitrarily by the reference and by lowest index here; with 16 or more index heads they do not occur
in these prompts. NeMo has no KV cache, so its greedy continuation is checked in one forward: each of
our greedy tokens must be NeMo's argmax after the prompt and our earlier tokens.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from deepinfer import kernels
from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import load_checkpoint
from deepinfer.families.tensor_spec import FP4, FP8
from deepinfer.families.v41.layout import QUANTIZATION, ROW_GROUP, expected_tensors_v41, is_optional, released_format
from deepinfer.families.v41.config import FULL, REINDEX, REUSE, SWA, LayerRole, V41Config
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.families.v41.engram import compressed_token_map, engram_layouts
from deepinfer.families.v41.model import DeepseekV41
from deepinfer.recipe.tokenizer import PAD, build_tokenizer
from deepinfer.kernels.quant import fp8_block_encode
from test_config_v41 import flash_text

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
TOLERANCE = 1e-4
# With the cache QDQ on both sides, a one-ulp difference between the engine's and NeMo's sum orders can
# land a cache value on the other side of an FP8 / FP4 rounding midpoint, moving it a whole step: case A
# drifts 4.0e-4 so since the small tokenizer gained the official special tokens (Engram's compressed
# vocabulary, so its hash, changed), 5e-5 before; without the QDQ every case stays within TOLERANCE.
QDQ_TOLERANCE = 5e-4
GREEDY_TOKENS = 8
VOCAB = 512
MAX_MODEL_LEN = 256


def tiny_text(tokenizer, **changes) -> dict:
    """Flash's text fields scaled down to configuration A, then `changes`; the Engram table sizes follow
    from the result and `tokenizer`'s compressed ids."""
    text = flash_text()
    text.update(
        vocab_size=VOCAB, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2, n_routed_experts=8,
        num_experts_per_tok=2, sliding_window=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 256},
        compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5],
        index_n_heads=16, index_head_dim=32, index_topk=8, candidate_source_layer_id=3, candidate_topk_blocks=3,
        candidate_block_size=4, dspark_target_layer_ids=[], dspark_noise_token_id=500, dspark_n_routed_experts=8,
        dspark_num_experts_per_tok=2, engram_layer_ids=[0, 4], engram_max_ngram_size=3,
        engram_n_heads=2, engram_head_dim=16, engram_vocab_size=97,
    )
    text.update(changes)
    _, compressed = compressed_token_map(tokenizer)
    layouts = engram_layouts(text["engram_layer_ids"], text["engram_max_ngram_size"], text["engram_n_heads"],
                             text["engram_vocab_size"], compressed)
    text.update(engram_num_embeddings=[x.rows for x in layouts], engram_compressed_vocab_size=compressed,
                engram_pad_token_id=tokenizer.token_to_id(PAD))
    return text


class Case(NamedTuple):
    changes: dict  # to configuration A's fields
    prompt_len: int
    roles: list[LayerRole]  # what `V41Config.roles` must say


def _role(kind: str, ratio: int = 0, kv: int | None = None, index: int | None = None, *flags: str) -> LayerRole:
    """A `LayerRole` from its kind, ratio, sources and flags ('candidates', 'pool', 'engram')."""
    return LayerRole(kind, ratio, kv, index, candidate_source="candidates" in flags, uses_candidates="pool" in flags,
                     engram="engram" in flags)


CASES = {
    "A": Case({}, 70, [
        _role(SWA, 0, None, None, "engram"), _role(FULL, 2, 1, 1), _role(REUSE, 2, 1, 1),
        _role(FULL, 1, 3, 3, "candidates"), _role(REUSE, 1, 3, 3, "engram"), _role(REINDEX, 1, 3, 5, "pool"),
    ]),
    "B": Case(dict(
        hidden_size=160, moe_intermediate_size=32, num_hidden_layers=8, num_attention_heads=8, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=48, o_lora_rank=16, o_groups=4, n_routed_experts=12, num_experts_per_tok=3,
        routed_scaling_factor=2.5, sliding_window=8, rms_norm_eps=1e-20, max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 64},
        compress_ratios=[0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 0], kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 3, 5, 7], index_n_heads=24, index_head_dim=16, index_topk=6,
        candidate_source_layer_id=5, candidate_topk_blocks=4, candidate_block_size=3, engram_layer_ids=[1, 7],
        engram_max_ngram_size=4, engram_n_heads=3, engram_head_dim=32, engram_vocab_size=131,
        dspark_target_layer_ids=[5, 6, 7], dspark_n_routed_experts=4, dspark_markov_rank=8,
    ), 100, [
        _role(SWA), _role(SWA, 0, None, None, "engram"), _role(FULL, 1, 2, 2), _role(REINDEX, 1, 2, 3),
        _role(REUSE, 1, 2, 3), _role(FULL, 2, 5, 5, "candidates"), _role(REUSE, 2, 5, 5),
        _role(REINDEX, 2, 5, 7, "pool", "engram"),
    ]),
    "C": Case(dict(
        hidden_size=96, moe_intermediate_size=64, num_hidden_layers=7, num_attention_heads=6, head_dim=48,
        qk_rope_head_dim=16, q_lora_rank=40, o_lora_rank=24, o_groups=3, n_routed_experts=6, swiglu_limit=0.25,
        sliding_window=12, hc_sinkhorn_iters=7, max_position_embeddings=1024,
        rope_scaling={"rope_type": "yarn", "factor": 8, "beta_fast": 16, "beta_slow": 2,
                      "original_max_position_embeddings": 128},
        compress_ratios=[2, 2, 2, 0, 1, 1, 1], kv_source_layer_ids=[0, 4, 5], index_source_layer_ids=[0, 2, 4, 5],
        index_n_heads=16, index_head_dim=24, index_topk=10, candidate_source_layer_id=-1, engram_layer_ids=[0, 3],
        engram_max_ngram_size=2, engram_n_heads=4, engram_head_dim=32, engram_vocab_size=61,
        num_nextn_predict_layers=0,
    ), 150, [
        _role(FULL, 2, 0, 0, "engram"), _role(REUSE, 2, 0, 0), _role(REINDEX, 2, 0, 2),
        _role(SWA, 0, None, None, "engram"), _role(FULL, 1, 4, 4), _role(FULL, 1, 5, 5), _role(REUSE, 1, 5, 5),
    ]),
}


@dataclass
class Oracle:
    """NeMo's model for one configuration, what its adapters export, and our config, tokenizer and prompt."""

    case: Case
    text: dict  # our text fields, as NeMo was built from them
    config: V41Config
    tokenizer: object
    model: torch.nn.Module
    released: dict[str, torch.Tensor]  # every tensor NeMo exports, in the released names
    prompt: list[int]
    _logits: dict[bool, torch.Tensor] = field(default_factory=dict)

    @property
    def backbone(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in self.released.items() if not is_optional(name)}

    def logits(self, ids: list[int], qdq: bool, model: torch.nn.Module | None = None) -> torch.Tensor:
        """NeMo's logits [len(ids), vocab] (of `model`, this oracle's by default), with or without the
        cache quantize-dequantize."""
        from nemo_automodel.components.models.deepseek_v41 import attention

        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            if not qdq:
                patch.setattr(attention, "quantize_cache", lambda values, **_: values)
            return (model or self.model)(torch.tensor([ids])).logits[0].float()

    def prompt_logits(self, qdq: bool) -> torch.Tensor:
        if qdq not in self._logits:
            self._logits[qdq] = self.logits(self.prompt, qdq)
        return self._logits[qdq]


def nemo_model(text: dict, tokenizer) -> torch.nn.Module:
    """NeMo's V4.1 model for our text fields, with a one-layer vision tower, randomly initialised in fp32."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import BackendConfig, DeepseekV41ForCausalLM

    fields = {k: v for k, v in text.items() if k != "model_type"}
    vision = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes on the release's field names
        config = DeepseekV41Config(text_config={**fields, "dtype": "float32"}, vision_config=vision, dtype="float32")
        backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                                dispatcher="torch", rope="torch", gate_precision="float32")
        model = DeepseekV41ForCausalLM(config, backend=backend,
                                       tokenizer=PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return model.eval()


def draft_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The `mtp.*` tensors of NeMo's DSpark draft for `model`'s config, in the released names."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as in `nemo_model`
        draft = DeepseekV41DSparkModel(model.config.text_config, num_anchors=1, enable_confidence_head=True)
    exported = draft.state_dict_adapter.to_hf(draft.state_dict())
    return {name: t.detach().float().clone() for name, t in exported.items() if name.startswith("mtp.")}


@pytest.fixture(scope="module", params=list(CASES))
def oracle(request) -> Oracle:
    case = CASES[request.param]
    tokenizer = build_tokenizer(VOCAB)
    text = tiny_text(tokenizer, **case.changes)
    torch.manual_seed(0)
    model = nemo_model(text, tokenizer)
    with torch.no_grad():  # the initialisation leaves these at 0 / 1; random values exercise them
        for name, param in model.named_parameters():
            if name.endswith(("sinks_param.weight", "e_score_correction_bias", ".base", ".scale")):
                param.normal_(0, 0.5)
            elif name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):
                param.uniform_(0.5, 1.5)
    released = {name: t.detach().clone() for name, t in model.state_dict_adapter.to_hf(model.state_dict()).items()}
    if text["dspark_target_layer_ids"]:
        released.update(draft_tensors(model))
    config = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": text})
    prompt = torch.randint(0, VOCAB, (case.prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    return Oracle(case, text, config, tokenizer, model, released, prompt)


class Reference(NamedTuple):
    oracle: Oracle
    qdq: bool  # whether the caches are quantize-dequantized (both sides)
    logits: torch.Tensor  # NeMo's, at every prompt position [L, vocab]


@pytest.fixture(scope="module", params=[False, True], ids=["qdq-off", "qdq-on"])
def reference(request, oracle) -> Reference:
    return Reference(oracle, request.param, oracle.prompt_logits(request.param))


def engine(reference: Reference) -> tuple[DeepseekV41, CacheManager, ModelRunner]:
    oracle = reference.oracle
    model = DeepseekV41(oracle.config, kernels.bind("batch_invariant", "cpu"), torch.float32, device="meta",
                        cache_qdq=reference.qdq)
    model.load_tensors(oracle.backbone, "cpu")
    model.use_tokenizer(oracle.tokenizer)
    cache = CacheManager(model.pools, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_step_tokens=MAX_MODEL_LEN,
                         num_blocks=None, block_size=16, dtype=torch.float32, device="cpu")
    return model, cache, ModelRunner(model, cache, "cpu")


def chunked_logits(parts, prompts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Every position's logits of each prompt, computed `chunk` tokens per sequence per step, all
    prompts in the same steps."""
    model, cache, runner = parts
    seqs = [Sequence(i, ids, SamplingParams(temperature=0), seed=0) for i, ids in enumerate(prompts)]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for start in range(0, max(map(len, prompts)), chunk):
        pieces = [ScheduledChunk(seq, start, min(chunk, len(seq.token_ids) - start))
                  for seq in seqs if start < len(seq.token_ids)]
        for piece in pieces:
            cache.grow(piece.seq.blocks, piece.end)
        batch, _ = runner.build_batch(pieces)
        batch.sample_index = None
        logits = model.logits(model(batch, cache.layer_views))
        offset = 0
        for piece in pieces:
            rows[piece.seq.request_id].append(logits[offset:offset + piece.num_tokens])
            offset += piece.num_tokens
            cache.release_behind(piece.seq.blocks, piece.end)
    for seq in seqs:
        cache.free(seq.blocks)
    return [torch.cat(r) for r in rows]


def serve(folder, tensors: dict[str, torch.Tensor], oracle: Oracle, qdq: bool, config: V41Config | None = None):
    """`tensors` written as a checkpoint folder with `config` (the oracle's by default), served by `LLM`:
    the prompt's output with prompt logprobs and greedy tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps((config or oracle.config).to_dict()))
    oracle.tokenizer.save(str(folder / "tokenizer.json"))
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, prompt_logprobs=True)
    return LLM(folder, max_model_len=MAX_MODEL_LEN, cache_qdq=qdq).generate([oracle.prompt], params)[0]


def assert_like_nemo(out, oracle: Oracle, qdq: bool, logits: torch.Tensor, model: torch.nn.Module | None = None):
    """`out`'s prompt logprobs within TOLERANCE (QDQ_TOLERANCE with the cache QDQ) of NeMo's `logits`,
    and each greedy token NeMo's argmax after the prompt and the tokens before it."""
    prompt = torch.tensor(oracle.prompt)
    want = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), prompt[1:]]
    drift = (torch.tensor(out.prompt_logprobs) - want).abs().max().item()
    assert drift <= (QDQ_TOLERANCE if qdq else TOLERANCE), f"prompt logprobs {drift:.2e} from NeMo"
    assert len(out.token_ids) == GREEDY_TOKENS
    continued = oracle.logits(oracle.prompt + out.token_ids[:-1], qdq, model)[len(prompt) - 1:]
    assert continued.argmax(dim=-1).tolist() == out.token_ids


def test_the_configuration_has_its_roles(oracle):
    """Ours as the case's table says, and NeMo built the same: compressor, indexer, candidate pool, Engram."""
    roles = oracle.config.roles
    assert roles == oracle.case.roles
    built = [(layer.attn.compress_ratio, layer.attn.compressor is not None, layer.attn.indexer is not None,
              layer.attn.indexer is not None and layer.attn.indexer.is_candidate_source,
              layer.attn.indexer is not None and layer.attn.indexer.uses_candidates, layer.engram is not None)
             for layer in oracle.model.model.layers.values()]
    assert built == [(r.ratio, r.kind == FULL, r.kind in (FULL, REINDEX), r.candidate_source, r.uses_candidates,
                      r.engram) for r in roles]


def test_the_configurations_cover_every_role():
    roles = [role for case in CASES.values() for role in case.roles]
    assert {(r.kind, r.ratio) for r in roles} == {
        (SWA, 0), (FULL, 1), (FULL, 2), (REUSE, 1), (REUSE, 2), (REINDEX, 1), (REINDEX, 2)}
    assert {r.ratio for r in roles if r.candidate_source} == {1, 2}
    assert {r.uses_candidates for r in roles if r.kind == REINDEX} == {True, False}
    assert {r.kind for r in roles if r.engram} == {SWA, FULL, REUSE, REINDEX}
    assert all(sum(r.engram for r in case.roles) == 2 for case in CASES.values())


@pytest.mark.parametrize("chunk", [None, 37, 1], ids=["prefill", "chunks-37", "decode"])
def test_logits_match_nemo_in_prefill_chunks_and_decode(reference, chunk):
    prompt = reference.oracle.prompt
    got = chunked_logits(engine(reference), [prompt], chunk or len(prompt))[0]
    drift = (got - reference.logits).abs().max().item()
    assert drift <= (QDQ_TOLERANCE if reference.qdq else TOLERANCE), f"chunk {chunk}: {drift:.2e} from NeMo"


def test_a_sequence_is_bitwise_the_same_alone_and_batched(reference):
    prompt = reference.oracle.prompt
    other = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(9)).tolist()
    alone = chunked_logits(engine(reference), [prompt], len(prompt))[0]
    batched = chunked_logits(engine(reference), [other, prompt], 13)[1]
    assert torch.equal(alone, batched)


def test_the_engine_serves_the_released_layout_like_nemo(reference, tmp_path):
    """End to end: everything NeMo's adapters export (the vision tower, aligner, image-token router biases
    and, where the config has them, the DSpark draft layers included, all left unused), written as a
    checkpoint folder and served by `LLM` with `cache_qdq` as the reference ran."""
    oracle = reference.oracle
    extras = {name.split(".")[0] for name in oracle.released if is_optional(name)}
    assert extras >= {"vision", "aligner", "image_start"}
    assert ("mtp" in extras) == bool(oracle.config.dspark_target_layer_ids)
    assert any(name.endswith(".ffn.gate.bias_vl") for name in oracle.released)
    out = serve(tmp_path, oracle.released, oracle, reference.qdq)
    assert_like_nemo(out, oracle, reference.qdq, reference.logits)


def quantized_copy(oracle: Oracle) -> dict[str, torch.Tensor]:
    """NeMo's fp32 export in the release's quantized form: MXFP4 routed experts by NeMo's
    `quantize_mxfp4`, FP8 dense weights (32x32 tiles) and Engram tables (a row and 32 columns) by our
    `fp8_block_encode`, each beside its E8M0 `.scale` (the DSpark draft layers' too, as released);
    everything else as exported."""
    from nemo_automodel.components.quantization.mxfp4 import quantize_mxfp4

    specs = expected_tensors_v41(released_format(oracle.config), include_mtp=True)
    out = {}
    for name, tensor in oracle.released.items():
        kind = specs[name].kind if name in specs else None
        if kind not in (FP8, FP4):
            out[name] = tensor
            continue
        tile = (1, ROW_GROUP) if ".engram.embed." in name else tuple(QUANTIZATION["weight_block_size"])
        out[name], out[name.removesuffix(".weight") + ".scale"] = (
            quantize_mxfp4(tensor) if kind == FP4 else fp8_block_encode(tensor, tile))
    return out


def test_a_quantized_export_serves_exactly_its_decoded_values_and_like_nemo(oracle, tmp_path):
    """NeMo's adapter writes no quantized values (`to_hf(quantization=True)` only allocates empty load
    targets), so its fp32 export is quantized as `quantized_copy` says; where NeMo can allocate those
    targets, their names, shapes and dtypes are the copy's. That copy (with `quantization_config`) and a
    plain copy holding its values as NeMo's `dequantize_checkpoint_weight` decodes them serve bit for
    bit alike, and NeMo loading the quantized copy through its adapter's `from_hf` agrees with the
    engine within TOLERANCE.

    Without the cache QDQ: on weights from the FP8 / FP4 grids, the one-ulp differences between the
    engine's and NeMo's sum orders land cache values on opposite sides of an FP8 / FP4 rounding midpoint
    far more often than on the fp32 export, and each such flip moves an entry by a whole step (with
    other random weights B's layer-1 window KV held exactly -1.6875 at position 40, NeMo's the float
    below it: 0.15 in logits; with these, A and C drift by 5e-5 and 3e-5), so a tolerance would hold by
    luck. The fp32 export is compared with the QDQ on and off above."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    quantized = quantized_copy(oracle)
    if oracle.config.engram_head_dim % 32 == 0:  # NeMo's load targets need whole 32-column scale groups
        targets = oracle.model.state_dict_adapter.to_hf(oracle.model.state_dict(), quantization=True,
                                                        for_checkpoint_load=True)
        ours = {name: (t.shape, t.dtype) for name, t in quantized.items() if not name.startswith("mtp.")}
        assert ours == {name: (t.shape, t.dtype) for name, t in targets.items()}
    plain = {name: t for name, t in quantized.items() if not name.endswith(".scale")}
    for name, tensor in plain.items():
        scale = quantized.get(name.removesuffix(".weight") + ".scale")
        if scale is not None:
            plain[name] = dequantize_checkpoint_weight(tensor, scale, dtype=torch.float32,
                                                       rowwise=".engram.embed." in name)
    got = serve(tmp_path / "quantized", quantized, oracle, False, released_format(oracle.config))
    other = serve(tmp_path / "plain", plain, oracle, False)
    assert (got.prompt_logprobs, got.token_ids, got.logprobs) == (
        other.prompt_logprobs, other.token_ids, other.logprobs)
    decoded = load_checkpoint(tmp_path / "quantized").tensors
    assert decoded.keys() == {name for name in plain if not is_optional(name)}
    assert all(torch.equal(decoded[name], plain[name]) for name in decoded)

    nemo = nemo_model(oracle.text, oracle.tokenizer)
    nemo.load_state_dict(nemo.state_dict_adapter.from_hf(dict(quantized)), strict=True)
    logits = oracle.logits(oracle.prompt, False, nemo)
    assert (logits - oracle.prompt_logits(False)).abs().max() > 100 * TOLERANCE  # quantizing changed the weights
    assert_like_nemo(got, oracle, False, logits, nemo)
