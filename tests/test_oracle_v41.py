"""The V4.1 model (deepinfer/model/transformer_v41.py, csa2.py) against NeMo AutoModel's V4.1 port on CPU
in fp32, on a tiny configuration with every CSA2 role: window-only, Full at ratio 2 with a Reuse
layer after it, Full at ratio 1 that also picks the candidate pool, Reuse at ratio 1, and Reindex
restricted to the pool. NeMo's weights go through its own state-dict adapter into the released
tensor names, which our model loads.

Engram sits at the window-only layer and at a Reuse layer, with our tiny tokenizer's compressed
ids. Not covered yet: the cache quantize-dequantize (NeMo's is turned off here), the DSpark layers. Exact ties in the indexer's top-k (entries whose score is
exactly 0 because every head's dot product is negative) are broken arbitrarily by the reference
and by lowest index here; with 16 index heads they do not occur in these prompts.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

import kernels
from deepinfer import LLM, SamplingParams
from deepinfer.config_v41 import FULL, REINDEX, REUSE, SWA, V41Config
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.model.engram import compressed_token_map, engram_layouts
from deepinfer.model.transformer_v41 import DeepseekV41
from deepinfer.recipe.tokenizer import PAD, build_tokenizer
from test_config_v41 import flash_text

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
TOLERANCE = 1e-4
PROMPT_LEN = 70
GREEDY_TOKENS = 8
VOCAB = 512


def tiny_text(tokenizer) -> dict:
    """Every role, and Engram at a window-only layer and a Reuse layer (sized for `tokenizer`)."""
    _, compressed = compressed_token_map(tokenizer)
    layouts = engram_layouts([0, 4], 3, 2, 97, compressed)
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
        dspark_num_experts_per_tok=2, engram_layer_ids=[0, 4], engram_num_embeddings=[x.rows for x in layouts],
        engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=16, engram_vocab_size=97,
        engram_compressed_vocab_size=compressed, engram_pad_token_id=tokenizer.token_to_id(PAD),
    )
    return text


@pytest.fixture(scope="module", params=[False, True], ids=["qdq-off", "qdq-on"])
def reference(request, monkeypatch_module) -> tuple:
    """(our config, the released-layout tensors, a prompt [L], NeMo's logits [L, vocab], the tokenizer,
    whether the caches are quantize-dequantized, NeMo's greedy continuation of the prompt)."""
    from nemo_automodel.components.models.deepseek_v41 import attention as nemo_attention
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import BackendConfig, DeepseekV41ForCausalLM

    qdq = request.param
    if not qdq:
        monkeypatch_module.setattr(nemo_attention, "quantize_cache", lambda values, **_: values)
    tokenizer = build_tokenizer(VOCAB)
    text = tiny_text(tokenizer)
    fields = {k: v for k, v in text.items() if k != "model_type"}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes on the release's field names
        nemo_config = DeepseekV41Config(text_config=fields, vision_config=None, dtype="float32")
        backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                                dispatcher="torch", rope="torch", gate_precision="float32")
        model = DeepseekV41ForCausalLM(nemo_config, backend=backend,
                                       tokenizer=PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():  # the initialisation leaves these at 0 / 1; random values exercise them
        for name, param in model.named_parameters():
            if name.endswith(("sinks_param.weight", "e_score_correction_bias", ".base", ".scale")):
                param.normal_(0, 0.5)
    model.eval()
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(prompt.unsqueeze(0)).logits[0].float()
        greedy = prompt.tolist()
        for _ in range(GREEDY_TOKENS):  # NeMo has no cache: each token recomputes the whole sequence
            greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
    released = model.state_dict_adapter.to_hf(model.state_dict())
    tensors = {name: t.detach().clone() for name, t in released.items()
               if not name.startswith(("vision.", "aligner.", "image_")) and not name.endswith("gate.bias_vl")}
    config = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": text})
    monkeypatch_module.undo()
    return config, tensors, prompt, logits, tokenizer, qdq, greedy[PROMPT_LEN:]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def engine(reference) -> tuple[DeepseekV41, CacheManager, ModelRunner]:
    config, tensors, *_, tokenizer, qdq, _ = reference
    model = DeepseekV41(config, kernels.bind("batch_invariant", "cpu"), torch.float32, device="meta", cache_qdq=qdq)
    model.load_tensors(dict(tensors), "cpu")
    model.use_tokenizer(tokenizer)
    cache = CacheManager(model.pools, max_num_seqs=4, max_model_len=256, max_step_tokens=256, num_blocks=None,
                         block_size=16, dtype=torch.float32, device="cpu")
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


def test_the_configuration_has_every_role(reference):
    roles = reference[0].roles
    assert [(r.kind, r.ratio) for r in roles] == [(SWA, 0), (FULL, 2), (REUSE, 2), (FULL, 1), (REUSE, 1), (REINDEX, 1)]
    assert roles[3].candidate_source and roles[5].uses_candidates
    assert [i for i, r in enumerate(roles) if r.engram] == [0, 4]


@pytest.mark.parametrize("chunk", [PROMPT_LEN, 37, 1])
def test_logits_match_nemo_in_prefill_chunks_and_decode(reference, chunk):
    prompt, want = reference[2], reference[3]
    got = chunked_logits(engine(reference), [prompt.tolist()], chunk)[0]
    drift = (got - want).abs().max().item()
    assert drift <= TOLERANCE, f"chunk {chunk}: {drift:.2e} from NeMo"


def test_a_sequence_is_bitwise_the_same_alone_and_batched(reference):
    prompt = reference[2]
    other = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(9)).tolist()
    alone = chunked_logits(engine(reference), [prompt.tolist()], PROMPT_LEN)[0]
    batched = chunked_logits(engine(reference), [other, prompt.tolist()], 13)[1]
    assert torch.equal(alone, batched)


def test_the_engine_serves_the_released_layout_like_nemo(reference, tmp_path):
    """End to end: the tensors NeMo's adapter exports, written as a checkpoint folder, served by `LLM`
    (with `cache_qdq` as the reference ran): prompt logprobs and greedy tokens."""
    config, tensors, prompt, logits, tokenizer, qdq, greedy = reference
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    save_file({name: t.contiguous() for name, t in tensors.items()}, tmp_path / "model.safetensors")
    llm = LLM(tmp_path, max_model_len=256, cache_qdq=qdq)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, prompt_logprobs=True)
    out = llm.generate([prompt.tolist()], params)[0]
    want = torch.log_softmax(logits, dim=-1)[torch.arange(PROMPT_LEN - 1), prompt[1:]]
    assert (torch.tensor(out.prompt_logprobs) - want).abs().max().item() <= TOLERANCE
    assert out.token_ids == greedy
