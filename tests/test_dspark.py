"""The DSpark draft model of V4.1 (deepinfer/families/v41/dspark.py) and its `mtp.*` tensors.

Layout: `checkpoint create --preset v41-tiny` writes the draft layers as `expected_tensors_v41(config,
include_mtp=True)` lists them (FP8 / MXFP4 like the release with `--quantized`); the loader checks
them when present (a misshapen or missing one is refused in one line), accepts checkpoints without
them, and `load_draft_tensors` hands them to `DSpark`.

Oracle: NeMo AutoModel's DSpark modules on configuration B of tests/test_oracle_v41.py (window 8,
three draft layers of 4 experts, Markov rank 8), in fp32 on CPU with random weights (norms, sinks,
router biases, mixing and the Markov and confidence heads included) that NeMo's adapter exports in the
released names and our `DSpark` loads. One block at anchors 5 (whole context) and 30 (the window
trims it to 22..29): base logits, Markov-corrected logits, greedy drafts and confidence logits (the
released pre-norm input computed by hand from NeMo's modules, the post-norm input as NeMo's own
forward computes it), with the cache quantize-dequantize on and off on both sides (NeMo's draft
imports `quantize_cache` into its own module, so that is where it is switched off). The features
our target hands the draft are compared with those of NeMo's capture point (a pre-hook on each
target layer's `attn_hc`).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_edits import copy_with

from deepinfer import kernels
from deepinfer.checkpoint import CheckpointError, load_checkpoint, load_draft_tensors
from deepinfer.families.tensor_spec import FP4, FP8
from deepinfer.families.v41.layout import expected_tensors_v41, is_draft_tensor, is_optional, released_format
from deepinfer.families.v41.presets import v41_preset_config
from deepinfer.checkpoint.random_init import stored_random_tensors
from deepinfer.cli import main
from deepinfer.families.v41.config import V41Config
from deepinfer.families.v41.dspark import POST_NORM, PRE_NORM, DSpark
from deepinfer.families.v41.model import DeepseekV41
from deepinfer.recipe.tokenizer import build_tokenizer

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
TOLERANCE = 1e-4
ANCHORS = (5, 30)
FEATURE_TOKENS = 40


def draft_names(config: V41Config) -> dict:
    return {name: spec for name, spec in expected_tensors_v41(config, include_mtp=True).items()
            if name.startswith("mtp.")}


def loaded_draft(config: V41Config, tensors: dict, qdq: bool = True, confidence_input: str = PRE_NORM) -> DSpark:
    draft = DSpark(config, kernels.bind("batch_invariant", "cpu"), torch.float32, device="meta", cache_qdq=qdq,
                   confidence_input=confidence_input)
    left = dict(tensors)
    draft.load_tensors(left, "cpu")
    assert not left  # every tensor has its parameter
    return draft


# -- layout, writer, loader ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dspark") / "v41-tiny"
    assert main(["checkpoint", "create", "--preset", "v41-tiny", "--out", str(folder), "--seed", "3"]) == 0
    return folder


def test_the_layout_lists_the_released_draft_tensors():
    config = v41_preset_config("v41-tiny")  # hidden 128, 3 draft layers of 8 experts, rank 16, 3 target layers
    specs = draft_names(config)
    per_layer = 8 + 2 + 2 + 3 * 9 + 6  # attention, norms, router and its bias, 8 experts + shared, mixing
    assert len(specs) == 3 * per_layer + 2 + 4
    shapes = {name: spec.shape for name, spec in specs.items()}
    assert shapes["mtp.0.main_proj.weight"] == (128, 384) and shapes["mtp.0.main_norm.weight"] == (128,)
    assert shapes["mtp.2.markov_head.embed.weight"] == shapes["mtp.2.markov_head.head.weight"] == (1024, 16)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, 144)
    assert shapes["mtp.1.ffn.experts.7.w2.weight"] == (128, 64) and shapes["mtp.1.ffn.gate.bias"] == (8,)
    assert shapes["mtp.2.hc_ffn_fn"] == (24, 512) and shapes["mtp.0.attn.attn_sink"] == (4,)
    assert not any(".compressor." in n or ".indexer." in n or ".engram." in n for n in specs)
    assert "mtp.1.main_proj.weight" not in specs and "mtp.1.norm.weight" not in specs
    assert expected_tensors_v41(config).keys() == expected_tensors_v41(config, include_mtp=True).keys() - specs.keys()
    quantized = expected_tensors_v41(released_format(config), include_mtp=True)
    kinds = {name: quantized[name].kind for name in (
        "mtp.0.main_proj.weight", "mtp.1.attn.wo_b.weight", "mtp.2.ffn.shared_experts.w1.weight",
        "mtp.0.ffn.experts.3.w3.weight", "mtp.2.markov_head.head.weight", "mtp.0.ffn.gate.weight")}
    assert kinds == {"mtp.0.main_proj.weight": FP8, "mtp.1.attn.wo_b.weight": FP8,
                     "mtp.2.ffn.shared_experts.w1.weight": FP8, "mtp.0.ffn.experts.3.w3.weight": FP4,
                     "mtp.2.markov_head.head.weight": "weight", "mtp.0.ffn.gate.weight": "weight"}
    assert quantized["mtp.0.main_proj.scale"].shape == (4, 12)
    assert quantized["mtp.0.ffn.experts.3.w2.weight"].shape == (128, 32)


def test_configs_without_draft_layers_list_none():
    config = v41_preset_config("v41-tiny")
    config.dspark_target_layer_ids = []
    assert not draft_names(config)


def test_in_memory_builds_have_no_draft_and_the_backbone_as_before():
    config = v41_preset_config("v41-tiny")
    plain = stored_random_tensors(config, 0, torch.float32, include_mtp=False)
    full = stored_random_tensors(config, 0, torch.float32)
    assert set(plain) == set(expected_tensors_v41(config)) == set(full) - set(draft_names(config))
    for name in ("layers.3.attn.wkv.weight", "embed.weight", "layers.5.ffn.experts.2.w1.weight"):
        assert torch.equal(plain[name], full[name])  # values are keyed by name: the draft changes none
    assert abs(full["mtp.0.main_norm.weight"].mean().item() - 1) < 0.05
    assert full["mtp.0.main_proj.weight"].std().item() == pytest.approx(384**-0.5, rel=0.05)


def test_a_written_checkpoint_has_the_draft_and_loads_it(tiny_folder):
    config = load_checkpoint(tiny_folder).config
    stored = load_file(tiny_folder / "model.safetensors")
    assert {n for n in stored if n.startswith("mtp.")} == set(draft_names(config))
    ckpt = load_checkpoint(tiny_folder)
    assert ckpt.has_mtp and not any(n.startswith("mtp.") for n in ckpt.tensors)
    tensors = load_draft_tensors(tiny_folder)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {n: s.shape for n, s in draft_names(config).items()}
    assert torch.equal(tensors["mtp.1.attn.wq_b.weight"], stored["mtp.1.attn.wq_b.weight"])
    draft = loaded_draft(config, tensors)
    assert draft.mtp[2].ffn.experts.w13.shape == (8, 128, 128)
    assert torch.equal(draft.mtp[0].main_proj.weight, stored["mtp.0.main_proj.weight"])


def test_a_quantized_checkpoint_stores_the_draft_as_released_and_decodes_it(tmp_path):
    folder = tmp_path / "q"
    assert main(["checkpoint", "create", "--preset", "v41-tiny", "--out", str(folder), "--seed", "3",
                 "--quantized"]) == 0
    stored = load_file(folder / "model.safetensors")
    assert stored["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["mtp.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["mtp.1.ffn.experts.5.w1.weight"].shape == (64, 64)  # [64, 128] as packed E2M1 pairs
    assert stored["mtp.2.markov_head.embed.weight"].dtype == torch.float32
    tensors = load_draft_tensors(folder)
    assert not any(name.endswith(".scale") for name in tensors)
    assert tensors["mtp.1.ffn.experts.5.w1.weight"].shape == (64, 128)
    plain = stored_random_tensors(v41_preset_config("v41-tiny"), 3, torch.float32)["mtp.0.attn.wkv.weight"]
    decoded = tensors["mtp.0.attn.wkv.weight"]
    assert decoded.dtype == torch.float32 and not torch.equal(decoded, plain)
    assert (decoded - plain).abs().max() <= plain.abs().max() / 8  # FP8's 3 mantissa bits
    loaded_draft(load_checkpoint(folder).config, tensors)


def test_a_misshapen_draft_tensor_is_refused_in_one_line(tiny_folder, tmp_path):
    copy_with(tiny_folder, tmp_path / "bad", lambda t: t.__setitem__("mtp.1.attn.wkv.weight", torch.zeros(3, 128)))
    for load in (load_checkpoint, load_draft_tensors):
        with pytest.raises(CheckpointError) as err:
            load(tmp_path / "bad")
        assert str(err.value) == "mtp.1.attn.wkv.weight: shape (3, 128) does not match config (64, 128)"


def test_a_partial_draft_is_refused_in_one_line(tiny_folder, tmp_path):
    copy_with(tiny_folder, tmp_path / "partial", lambda t: t.pop("mtp.2.markov_head.head.weight"))
    n = len(draft_names(load_checkpoint(tiny_folder).config))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "partial")
    assert str(err.value) == f"partial MTP set: {n - 1} of {n} mtp.* tensors present, missing " \
                             "mtp.2.markov_head.head.weight"


def test_a_checkpoint_without_the_draft_still_loads(tiny_folder, tmp_path):
    def strip(tensors):
        for name in [n for n in tensors if n.startswith("mtp.")]:
            del tensors[name]
        tensors["layers.2.ffn.gate.bias_vl"] = torch.zeros(16)  # optional extras stay optional
        tensors["vision.patch.weight"] = torch.zeros(2)

    folder = tmp_path / "backbone"
    copy_with(tiny_folder, folder, strip)
    ckpt = load_checkpoint(folder)
    assert not ckpt.has_mtp and ckpt.tensors.keys() == load_checkpoint(tiny_folder).tensors.keys()
    with pytest.raises(CheckpointError) as err:
        load_draft_tensors(folder)
    assert str(err.value) == f"{folder}: the checkpoint has no DSpark draft layers (mtp.* tensors)"


def test_a_block_reads_exactly_its_window_of_context(tiny_folder):
    config = load_checkpoint(tiny_folder).config
    draft = loaded_draft(config, load_draft_tensors(tiny_folder))
    assert draft.context_positions(5) == range(0, 5) and draft.context_positions(40) == range(8, 40)
    with pytest.raises(ValueError) as err:
        draft.block(7, 40, torch.zeros(3, 31, config.head_dim))
    assert str(err.value) == ("a draft block at position 40 reads 32 context rows (positions 8..39) in each of "
                              "3 layers, got context KV of shape (3, 31, 64)")


# -- NeMo oracle -----------------------------------------------------------------------------------------------

class Nemo:
    """NeMo's target and DSpark draft for configuration B, randomised; our target and config beside them."""

    def __init__(self) -> None:
        from test_oracle_v41 import CASES, VOCAB, nemo_model, tiny_text
        from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
        from nemo_automodel.components.models.deepseek_v41.model import BackendConfig

        self.tokenizer = build_tokenizer(VOCAB)
        text = tiny_text(self.tokenizer, **CASES["B"].changes)
        torch.manual_seed(0)
        self.target = nemo_model(text, self.tokenizer)
        backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                                dispatcher="torch", rope="torch", gate_precision="float32")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.draft = DeepseekV41DSparkModel(self.target.config.text_config, backend, num_anchors=1,
                                                enable_confidence_head=True).eval()
        self.draft.initialize_embeddings_and_head(embed_tokens=self.target.model.embed_tokens,
                                                  lm_head=self.target.lm_head)
        with torch.no_grad():  # as tests/test_oracle_v41.py's oracle, plus decisive Markov and confidence heads
            for model in (self.target, self.draft):
                for name, param in model.named_parameters():
                    if name.endswith(("sinks_param.weight", "e_score_correction_bias", ".base", ".scale")):
                        param.normal_(0, 0.5)
                    elif name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):
                        param.uniform_(0.5, 1.5)
                    elif ".markov_head." in name or ".confidence_head." in name or ".main_proj." in name:
                        param.normal_(0, param.shape[-1] ** -0.5 * (0.5 if ".markov_head.head" in name else 1))
        self.config = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": text})
        released = self.target.state_dict_adapter.to_hf(self.target.state_dict())
        self.backbone = {n: t.detach().clone() for n, t in released.items() if not is_optional(n)}
        exported = self.draft.state_dict_adapter.to_hf(self.draft.state_dict())
        self.released_draft = {n: t.detach().float().clone() for n, t in exported.items() if is_draft_tensor(n)}
        self.prompt = torch.randint(0, VOCAB, (FEATURE_TOKENS,), generator=torch.Generator().manual_seed(5))
        self._runs: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def patch(self, patch: pytest.MonkeyPatch, qdq: bool) -> None:
        from nemo_automodel.components.models.deepseek_v41 import attention, dspark

        if not qdq:
            for module in (attention, dspark):
                patch.setattr(module, "quantize_cache", lambda values, **_: values)

    def run(self, qdq: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [T, 3 * hidden] as NeMo captures them, logits [T, vocab]) of the prompt."""
        if qdq not in self._runs:
            layers = list(self.config.dspark_target_layer_ids)
            captured = {}
            hooks = [module.register_forward_pre_hook(lambda m, inputs, k=k: captured.__setitem__(k, inputs[0]))
                     for k, module in zip(layers, self.target.get_dspark_target_feature_modules(layers))]
            with pytest.MonkeyPatch.context() as patch, torch.no_grad():
                self.patch(patch, qdq)
                logits = self.target(self.prompt.unsqueeze(0)).logits[0].float()
            for hook in hooks:
                hook.remove()
            self._runs[qdq] = torch.cat([captured[k][0].mean(dim=1) for k in layers], dim=-1), logits
        return self._runs[qdq]

    def block(self, anchor: int, token: int, qdq: bool) -> dict[str, torch.Tensor]:
        """NeMo's draft block at `anchor` after `token`: base logits, greedy Markov drafts, their logits,
        confidence logits from the pre-norm hidden (by hand) and the post-norm one (NeMo's forward)."""
        from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone

        draft, size = self.draft, self.config.dspark_block_size
        features = self.run(qdq)[0][:anchor].unsqueeze(0)
        anchors = torch.tensor([[anchor]])
        position_ids = draft.build_position_ids(anchors, anchor)
        mask = draft.build_attention_mask(anchors, torch.tensor([[True]]), anchor, torch.float32)
        ids = torch.tensor([[token] + [self.config.dspark_noise_token_id] * (size - 1)])
        last = draft.mtp[-1]
        seen = {}
        hook = last.norm.register_forward_hook(lambda m, inputs, out: seen.__setitem__("hidden", inputs[0][0]))
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            self.patch(patch, qdq)
            out = DeepseekV41DSparkBackbone.forward(draft, draft.embed_tokens(ids), features,
                                                    position_ids=position_ids, attention_mask=mask)
            base = draft.compute_logits(out.normalized_hidden_states)[0].float()
            previous, tokens, logits = [token], [], []
            for slot in range(size):
                bias, _ = last.markov_head(torch.tensor([previous[-1]]))
                logits.append(base[slot] + bias[0].float())
                tokens.append(int(logits[-1].argmax()))
                previous.append(tokens[-1])
            _, embedding = last.markov_head(torch.tensor(previous[:size]))
            pre_norm = last.confidence_head(seen["hidden"], embedding)
            post_norm = DeepseekV41DSparkBackbone.forward(
                draft, draft.embed_tokens(ids), features, position_ids=position_ids, attention_mask=mask,
                previous_token_ids=torch.tensor([previous[:size]])).confidence_pred[0]
        hook.remove()
        return dict(base=base, tokens=torch.tensor(tokens), logits=torch.stack(logits), pre_norm=pre_norm,
                    post_norm=post_norm)


@pytest.fixture(scope="module")
def nemo() -> Nemo:
    return Nemo()


def test_nemos_export_has_our_draft_layout(nemo):
    """NeMo's adapter exports the draft layers under the names and shapes `expected_tensors_v41` lists."""
    assert {name: tuple(t.shape) for name, t in nemo.released_draft.items()} == {
        name: spec.shape for name, spec in draft_names(nemo.config).items()}


def our_target(nemo: Nemo, qdq: bool) -> DeepseekV41:
    model = DeepseekV41(nemo.config, kernels.bind("batch_invariant", "cpu"), torch.float32, device="meta",
                        cache_qdq=qdq)
    model.load_tensors(dict(nemo.backbone), "cpu")
    model.use_tokenizer(nemo.tokenizer)
    return model


def drift(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("qdq", [False, True], ids=["qdq-off", "qdq-on"])
def test_our_target_hands_the_draft_nemos_features(nemo, qdq):
    """The streams our forward taps (after Engram: target layer 7 is an Engram layer) averaged as
    `target_features` are NeMo's capture within TOLERANCE, and tapping them changes no output bit."""
    from test_oracle_v41 import MAX_MODEL_LEN
    from deepinfer import SamplingParams
    from deepinfer.engine.cache import CacheManager
    from deepinfer.engine.runner import ModelRunner
    from deepinfer.engine.scheduler import ScheduledChunk
    from deepinfer.engine.sequence import Sequence

    model = our_target(nemo, qdq)
    assert model.roles[7].engram and 7 in nemo.config.dspark_target_layer_ids
    outputs, taps = [], []
    for tap in (None, {}):
        cache = CacheManager(model.pools, max_num_seqs=1, max_model_len=MAX_MODEL_LEN, max_step_tokens=MAX_MODEL_LEN,
                             num_blocks=None, block_size=16, dtype=torch.float32, device="cpu")
        seq = Sequence(0, nemo.prompt.tolist(), SamplingParams(temperature=0), seed=0)
        cache.grow(seq.blocks, FEATURE_TOKENS)
        batch, _ = ModelRunner(model, cache, "cpu").build_batch([ScheduledChunk(seq, 0, FEATURE_TOKENS)])
        batch.sample_index = None
        outputs.append(model(batch, cache.layer_views, streams_at=tap))
        taps.append(tap)
    assert torch.equal(outputs[0], outputs[1])
    assert sorted(taps[1]) == nemo.config.dspark_target_layer_ids
    features, logits = nemo.run(qdq)
    per_token = (model.logits(outputs[0]).float() - logits.float()).abs().amax(dim=-1)
    # With the cache QDQ a one-ulp difference in a sum can put one token's FP4 indexer query on the
    # other side of a rounding midpoint, which moves that token alone by a whole grid step (measured
    # here on an AMD EPYC: token 20 by 0.039, every other token by under 1e-6); one such token is
    # allowed, and every other token is held to TOLERANCE.
    agree = per_token <= TOLERANCE
    assert int((~agree).sum()) <= (1 if qdq else 0), per_token  # the target itself agrees
    draft = loaded_draft(nemo.config, nemo.released_draft, qdq)
    ours = draft.features({k: v[:FEATURE_TOKENS] for k, v in taps[1].items()})
    assert drift(ours[agree], features[agree]) <= TOLERANCE
    assert drift(draft.project(ours)[agree], draft.project(features)[agree]) <= TOLERANCE


@pytest.mark.parametrize("qdq", [False, True], ids=["qdq-off", "qdq-on"])
def test_a_draft_block_matches_nemo(nemo, qdq):
    """From NeMo's features: base logits, Markov-corrected logits and confidence logits within TOLERANCE,
    and the same greedy drafts, at an anchor inside the first window and one past it."""
    target = our_target(nemo, qdq)
    drafts = {confidence: loaded_draft(nemo.config, nemo.released_draft, qdq, confidence)
              for confidence in (PRE_NORM, POST_NORM)}
    for draft in drafts.values():
        draft.share(target)
    features, logits = nemo.run(qdq)
    corrected = False
    for anchor in ANCHORS:
        token = int(logits[anchor - 1].argmax())
        want = nemo.block(anchor, token, qdq)
        main_x = drafts[PRE_NORM].project(features[:anchor])
        positions = drafts[PRE_NORM].context_positions(anchor)
        rows = torch.arange(positions.start, positions.stop)
        out = drafts[PRE_NORM].block(token, anchor, drafts[PRE_NORM].context_kv(main_x[rows], rows))
        assert drift(out.logits, want["base"]) <= TOLERANCE, anchor
        for confidence, draft in drafts.items():
            got = draft.propose(token, anchor, main_x)
            assert got.tokens.tolist() == want["tokens"].tolist(), (anchor, confidence)
            assert drift(got.logits, want["logits"]) <= TOLERANCE, (anchor, confidence)
            assert drift(got.confidence_logits, want[confidence]) <= TOLERANCE, (anchor, confidence)
        corrected |= want["tokens"].tolist() != want["base"].argmax(dim=-1).tolist()
        assert drift(want["pre_norm"], want["post_norm"]) > 100 * TOLERANCE  # the two inputs differ
    assert corrected  # the Markov correction changed a draft somewhere: the comparison covers it
