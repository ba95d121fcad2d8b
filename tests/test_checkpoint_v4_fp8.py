"""DeepSeek-V4 checkpoints in transformers' quantized FP8 format (`FineGrainedFP8Config`), checked against
transformers itself.

transformers cannot write this format on a CPU: quantizing while loading refuses ("No GPU or XPU found.
A GPU or XPU is needed for FP8 quantization."). Past that check (the quantizing itself is plain PyTorch),
`save_pretrained` writes the routed experts' scales fused (`ffn.experts.gate_up_proj_scale_inv`), which
its own loader then reports as unexpected, and weights whose sides are not multiples of the tile it
leaves unquantized beside an uninitialised scale. So
the checkpoints here are the tiny preset's weights encoded by our `kernels.quant` encoders, under the
names, shapes and dtypes transformers loads. transformers vouches for them twice: its quantizer, run on
the model as `from_pretrained` runs it, converts exactly the weights we quantized, and its
`dequantize=True` load reads the folder with no missing, unexpected or misshapen key. Then transformers'
dequantized model and our engine agree on prompt logprobs to 1e-4 and on greedy tokens, and the engine
serves a quantized checkpoint bit for bit as it serves the decoded values stored plainly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import CheckpointError, expected_tensors, load_checkpoint, parameter_counts, preset_config
from deepinfer.families.tensor_spec import FP4, FP8
from deepinfer.families.v4.quantized import SCALE_SUFFIX
from deepinfer.cli import main
from deepinfer.families.v4.config import ConfigError, ModelConfig
from deepinfer.families.registry import load_config
from deepinfer.kernels.quant import fp8_block_encode, mxfp4_encode

transformers = pytest.importorskip("transformers")
from transformers.quantizers import AutoHfQuantizer  # noqa: E402  (after the importorskip)

TOLERANCE = 1e-4
PROMPT = torch.randint(2, 1024, (80,), generator=torch.Generator().manual_seed(5)).tolist()  # past the window
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=True)
FORMATS = {
    # transformers' default scale format: float32 `weight_scale_inv`, FP8 experts
    "fp8-experts": dict(weight_block_size=[128, 128], scale_fmt="float", expert_dtype="fp8"),
    # DeepSeek-V4-Flash's: E8M0 scales, MXFP4 routed experts
    "fp4-experts": dict(weight_block_size=[128, 128], scale_fmt="ue8m0", expert_dtype="fp4"),
}


@pytest.fixture(scope="module", autouse=True)
def _no_accelerate_needed():
    """transformers' FP8 quantizer refuses to start without `accelerate` ("Loading an FP8 quantized model
    requires accelerate"), before it looks at `dequantize=True`; a CPU load without a device_map calls
    nothing of accelerate, which is not among our dev dependencies."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("transformers.quantizers.quantizer_finegrained_fp8.is_accelerate_available", lambda: True)
        yield


def write_quantized(src: Path, dst: Path, **settings) -> Path:
    """The fp32 checkpoint `src` in transformers' FP8 format, `FineGrainedFP8Config(**settings)`."""
    quantization = json.loads(json.dumps(transformers.FineGrainedFP8Config(**settings).to_dict()))
    config = {**json.loads((src / "config.json").read_text()), "quantization_config": quantization}
    layout = expected_tensors(ModelConfig.from_dict(config), include_mtp=True)
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        kind = layout[name].kind
        if kind not in (FP8, FP4):
            tensors[name] = tensor
            continue
        weight, scale = fp8_block_encode(tensor, tuple(settings["weight_block_size"])) if kind == FP8 \
            else mxfp4_encode(tensor)
        tensors[name] = weight
        tensors[name + SCALE_SUFFIX] = scale if settings["scale_fmt"] == "ue8m0" else scale.float()
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized(request, tiny_checkpoint, tmp_path_factory) -> Path:
    return write_quantized(tiny_checkpoint, tmp_path_factory.mktemp("fp8") / request.param, **FORMATS[request.param])


@pytest.fixture(scope="module")
def dequantized(quantized):
    """transformers' model of `quantized`, loaded with `dequantize=True`, and its loading report."""
    return transformers.DeepseekV4ForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, output_loading_info=True,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
    )


@pytest.fixture(scope="module")
def served(quantized):
    """Our engine's greedy run of PROMPT from `quantized`."""
    return serve(quantized)


def serve(folder: Path):
    return LLM(folder, max_model_len=256).generate([PROMPT], PARAMS)[0]


def quantized_by_transformers(folder: Path) -> set[str]:
    """The parameters transformers' FP8 quantizer converts (those that gain a `_scale_inv`), applied to an
    empty model as `from_pretrained` applies it."""
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(config)
    AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True).preprocess_model(model)
    return {name.removesuffix(SCALE_SUFFIX) for name, _ in model.named_parameters() if name.endswith(SCALE_SUFFIX)}


def test_transformers_loads_and_quantizes_exactly_these_weights(quantized, dequantized, tiny_checkpoint):
    model, info = dequantized
    assert not any(info.values()), info  # mtp.* is dropped silently (`_keys_to_ignore_on_load_unexpected`)
    original = dict(transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint).named_parameters())
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, original[name])}
    assert changed == quantized_by_transformers(quantized)
    assert len(changed) == 4 * (5 + 2 + 3) + 2  # per layer: attention 5 + experts 2 + shared 3; indexers 2


def test_engine_matches_transformers_dequantized(quantized, dequantized, served):
    model, _ = dequantized
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], dim=-1)
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    want = logprobs[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    drift = (torch.tensor(served.prompt_logprobs) - want).abs().max().item()
    assert drift <= TOLERANCE, f"{quantized.name}: prompt logprobs drift {drift:.2e} from transformers"
    assert served.token_ids == greedy


def test_quantized_serves_bit_for_bit_like_its_decoded_values(quantized, served, tiny_checkpoint, tmp_path):
    decoded = load_checkpoint(quantized)
    original = load_checkpoint(tiny_checkpoint).tensors
    assert decoded.tensors.keys() == original.keys()
    assert all(decoded.tensors[name].dtype == t.dtype for name, t in original.items())
    changed = [name for name, t in original.items() if not torch.equal(decoded.tensors[name], t)]
    # quantizing changed them: in 4 layers and the draft block, 5 attention weights and w1-w3 of 16 routed
    # experts and the shared one; 2 indexers
    assert len(changed) == 5 * (5 + 3 * 17) + 2
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in decoded.tensors.items()}, plain / "model.safetensors")
    again = serve(plain)
    assert served.token_ids == again.token_ids
    assert served.logprobs == again.logprobs and served.prompt_logprobs == again.prompt_logprobs


def test_info_shows_the_format_and_logical_parameter_counts(quantized, tiny_checkpoint, capsys):
    assert main(["checkpoint", "info", str(quantized)]) == 0
    out = capsys.readouterr().out
    fmt = FORMATS[quantized.name]
    assert (f"quantized   FP8 E4M3 in 128x128 tiles, {fmt['scale_fmt']} scales; routed experts "
            f"{fmt['expert_dtype'].upper()} (transformers FineGrainedFP8)\n") in out
    assert parameter_counts(load_config(quantized), include_mtp=True) == \
        parameter_counts(load_config(tiny_checkpoint), include_mtp=True)


def _rewrite(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


SCALE = "model.layers.1.attn.wkv.weight_scale_inv"  # [64, 128] in one 128x128 tile


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop(SCALE), f"missing tensor {SCALE}"),
    (lambda t: t.__setitem__(SCALE, torch.ones(2, 1)), f"{SCALE}: shape (2, 1) does not match config (1, 1)"),
    (lambda t: t.__setitem__(SCALE, torch.ones(1, 1).to(torch.float8_e8m0fnu)),
     f"{SCALE}: dtype float8_e8m0fnu, expected float32"),
    (lambda t: t.__setitem__("model.layers.2.ffn.experts.0.w1.weight", torch.zeros(64, 128)),
     "model.layers.2.ffn.experts.0.w1.weight: dtype float32, expected float8_e4m3fn"),
])
def test_bad_scales_fail_in_one_line(tiny_checkpoint, tmp_path, change, message):
    folder = write_quantized(tiny_checkpoint, tmp_path / "q", **FORMATS["fp8-experts"])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_rewrite(folder, tmp_path / "bad", change))
    assert str(err.value) == message


def test_quantization_config_round_trips():
    raw = preset_config("tiny").to_dict()
    assert "quantization_config" not in ModelConfig.from_dict(raw).to_dict()  # as transformers writes it
    quantization = {"quant_method": "fp8", "weight_block_size": [64, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    config = ModelConfig.from_dict({**raw, "quantization_config": quantization})
    assert config.to_dict() == {**raw, "quantization_config": quantization}
    assert config.quantization("activation_scheme") == "dynamic"  # FineGrainedFP8Config's default


def _fp8(**settings) -> dict:
    return {"quantization_config": {"quant_method": "fp8", **settings}}


@pytest.mark.parametrize(("change", "message"), [
    (_fp8(quant_method="awq"), "field 'quantization_config.quant_method' must be one of ['fp8'], got 'awq'"),
    ({"quantization_config": {}}, "field 'quantization_config.quant_method' must be one of ['fp8'], got None"),
    (_fp8(expert_dtype="int4"), "field 'quantization_config.expert_dtype' must be one of ['fp8', 'fp4'], got 'int4'"),
    (_fp8(weight_block_size=[128]),
     "field 'quantization_config.weight_block_size' must be two positive integers, got [128]"),
    (_fp8(weight_block_size=[128, 0]),
     "field 'quantization_config.weight_block_size' must be two positive integers, got [128, 0]"),
    (_fp8(weight_block_size=None), "field 'quantization_config.weight_block_size' must be list[int], got NoneType None"),
    (_fp8(expert_dtype="fp4"),
     "field 'quantization_config.expert_dtype' 'fp4' needs scale_fmt 'ue8m0' (MXFP4 scales are E8M0)"),
    ({**_fp8(expert_dtype="fp4", scale_fmt="ue8m0"), "moe_intermediate_size": 63},
     "field 'quantization_config.expert_dtype' 'fp4' packs value pairs: hidden_size and moe_intermediate_size "
     "must be even"),
    (_fp8(modules_to_not_convert=["head"]),
     "field 'quantization_config.modules_to_not_convert' is not supported: V4 quantizes a fixed set of weights"),
    ({"quantization_config": "fp8"}, "field 'quantization_config' must be dict, got str 'fp8'"),
])
def test_bad_quantization_config_fails_in_one_line(change, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**preset_config("tiny").to_dict(), **change}, source="config.json")
    assert str(err.value) == f"config.json: {message}"
