"""V4.1 checkpoints in the released layout: written by `checkpoint create --preset v41-*`, described by
`checkpoint info`, loaded by `LLM`, and refused in one line when a tensor is missing or misshapen.
The draft layers (written with the backbone, checked when present), vision tower and image-token
router biases a released checkpoint also carries are accepted and left unused by `LLM`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_edits import copy_with

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import CheckpointError, files, load_checkpoint
from deepinfer.checkpoint.random_init import stored_random_tensors
from deepinfer.engine import host
from deepinfer.families.v41.layout import footprint
from deepinfer.families.v41.presets import v41_preset_config
from deepinfer.cli import main
from deepinfer.kernels.quant import QuantizedWeight

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
PROMPT = list(range(20, 70))


@pytest.fixture(scope="module")
def plain_v41_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v41") / "v41-tiny"
    assert main(["checkpoint", "create", "--preset", "v41-tiny", "--out", str(folder), "--seed", "4"]) == 0
    return folder


def test_info_describes_the_v41_schedule(plain_v41_checkpoint, capsys):
    assert main(["checkpoint", "info", str(plain_v41_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "model       DeepSeek-V4.1 (deepseek_v41)" in out
    assert "layers      6: swa x1, full r2 x1, reuse r2 x1, full r1 x1, reuse r1 x1, reindex r1 x1" in out
    assert "candidate pool from layer 3 (4 blocks of 4)" in out and "engram      layers [0, 4]" in out


def test_a_written_checkpoint_runs_as_its_preset_does(plain_v41_checkpoint):
    from_folder = LLM(plain_v41_checkpoint, max_model_len=256).generate([PROMPT], PARAMS)
    from_preset = LLM("preset:v41-tiny", seed=4, max_model_len=256).generate([PROMPT], PARAMS)
    assert from_folder[0].token_ids == from_preset[0].token_ids
    assert from_folder[0].logprobs == from_preset[0].logprobs


def test_released_extras_are_accepted_and_unused(plain_v41_checkpoint, tmp_path):
    folder = tmp_path / "released"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((plain_v41_checkpoint / name).read_bytes())
    tensors = load_file(plain_v41_checkpoint / "model.safetensors")
    assert "mtp.0.main_proj.weight" in tensors  # the writer stores the DSpark draft layers (tests/test_dspark.py)
    tensors.update({"vision.patch.weight": torch.zeros(2), "aligner.w1.weight": torch.zeros(2),
                    "image_start": torch.zeros(2), "layers.0.ffn.gate.bias_vl": torch.zeros(16),
                    "mtp.1.ffn.gate.bias_vl": torch.zeros(8)})
    save_file(tensors, folder / "model.safetensors")
    loaded = load_checkpoint(folder)
    assert loaded.has_mtp and not any(n.startswith(("mtp.", "vision.", "aligner.", "image_")) for n in loaded.tensors)
    assert LLM(folder, max_model_len=256).generate([PROMPT], PARAMS)[0].token_ids == \
        LLM(plain_v41_checkpoint, max_model_len=256).generate([PROMPT], PARAMS)[0].token_ids


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop("layers.3.attn.indexer.wk.weight"), "missing tensor layers.3.attn.indexer.wk.weight"),
    (lambda t: t.__setitem__("layers.2.attn.compressor.wkv.weight", torch.zeros(64, 128)),
     "unexpected tensor layers.2.attn.compressor.wkv.weight"),
    (lambda t: t.__setitem__("layers.4.engram.embed.weight", torch.zeros(10, 16)),
     "layers.4.engram.embed.weight: shape (10, 16) does not match config (4152, 16)"),
])
def test_bad_tensors_fail_in_one_line(plain_v41_checkpoint, tmp_path, change, message):
    folder = tmp_path / "bad"
    copy_with(plain_v41_checkpoint, folder, change)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert str(err.value) == message


def test_a_quantized_checkpoint_loads_exactly_its_decoded_values(plain_v41_checkpoint, tmp_path):
    """`--quantized` stores FP8 dense weights (32x32 tiles), MXFP4 experts and FP8 Engram tables with
    E8M0 scales; loading decodes them exactly, so it serves bit for bit like a plain checkpoint that
    holds the decoded values."""
    quantized = tmp_path / "quantized"
    assert main(["checkpoint", "create", "--preset", "v41-tiny", "--out", str(quantized), "--seed", "4",
                 "--quantized"]) == 0
    stored = load_file(quantized / "model.safetensors")
    assert stored["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.attn.wq_a.scale"].shape == (2, 4)  # [64, 128] in 32x32 tiles
    assert stored["layers.1.ffn.experts.3.w2.weight"].shape == (128, 32)  # [128, 64] as packed E2M1 pairs
    assert stored["layers.0.engram.embed.scale"].shape == (4062, 1)  # a scale per row and 32 columns
    decoded = load_checkpoint(quantized)
    assert not any(name.endswith(".scale") for name in decoded.tensors)
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    (plain / "tokenizer.json").write_bytes((quantized / "tokenizer.json").read_bytes())
    save_file({name: t.contiguous() for name, t in decoded.tensors.items()}, plain / "model.safetensors")
    got = [LLM(folder, max_model_len=256).generate([PROMPT], PARAMS)[0] for folder in (quantized, plain)]
    assert got[0].token_ids == got[1].token_ids and got[0].logprobs == got[1].logprobs
    original = LLM(plain_v41_checkpoint, max_model_len=256).generate([PROMPT], PARAMS)[0]
    assert got[0].logprobs != original.logprobs  # quantizing did change the weights


@pytest.mark.parametrize("device,dtype", [
    ("cpu", "float32"),
    pytest.param("cuda", "bfloat16", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_weights_kept_quantized_serve_the_bits_of_decoded_weights(tmp_path, device, dtype):
    """`weight_storage="quantized"` keeps the FP8 / MXFP4 weights as stored (the ops decode them where
    they are used, the Engram tables row by row; on CUDA the Triton matmuls decode B tiles in the
    kernel), and `engram_tables="host"` keeps the Engram tables in host memory (the runner reads each
    step's rows and uploads them with the step): tokens, logprobs and prompt logprobs are those of
    the weights decoded at load on the device, bit for bit, batched and in prefill chunks."""
    folder = tmp_path / "quantized"
    assert main(["checkpoint", "create", "--preset", "v41-tiny", "--out", str(folder), "--seed", "2",
                 "--quantized"]) == 0
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    prompts = [PROMPT, list(range(300, 341)), list(range(7, 19))]
    runs = {}
    for storage, tables in (("decoded", "device"), ("quantized", "device"), ("quantized", "host"), ("decoded", "host")):
        llm = LLM(folder, max_model_len=256, max_num_batched_tokens=32, weight_storage=storage, engram_tables=tables,
                  device=device, dtype=dtype)
        assert llm.engine_config.weight_storage == storage
        kept = [llm.model.layers[1].ffn.experts.w13, llm.model.layers[3].attn.wkv.weight,
                llm.model.layers[0].engram.embed.weight]
        assert all(isinstance(w, QuantizedWeight) for w in kept) == (storage == "quantized")
        table = llm.model.layers[4].engram.embed.weight
        assert (table.data if storage == "quantized" else table).device.type == ("cpu" if tables == "host" else device)
        runs[storage, tables] = [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)]
    assert all(run == runs["decoded", "device"] for run in runs.values())


def test_host_engram_tables_never_pass_the_device(v41_checkpoint, monkeypatch):
    """With engram_tables="host" the Engram tables (weights and scales) are read from the checkpoint, or
    generated for a preset, straight into host memory; every other tensor onto the device. (On a GPU,
    V4.1-Flash's 188.8 GiB of tables could not be loaded there first.) The device here is a stand-in
    name: the recorded reads say where each tensor was asked for."""
    reads, real_open, real_load = {}, files._open, host.load_checkpoint

    class Recording:  # a safetensors handle on the CPU that records the device it was opened for
        def __init__(self, path, device="cpu"):
            self.handle, self.device = real_open(path, "cpu"), str(device)

        def get_tensor(self, name):
            reads[name] = self.device
            return self.handle.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.__exit__(*exc)

    def load(folder, device, placement, **settings):  # the engine's device read as "gpu"
        return real_load(folder, device, placement=lambda name: "gpu" if placement(name) == device else
                         placement(name), **settings)

    monkeypatch.setattr(files, "_open", Recording)
    monkeypatch.setattr(host, "load_checkpoint", load)
    LLM(v41_checkpoint, engram_tables="host", weight_storage="quantized")
    tables = {name for name in reads if ".engram.embed." in name}
    assert len(tables) == 4 and {reads[name] for name in tables} == {"cpu"}  # two layers, weight and scale
    assert {device for name, device in reads.items() if name not in tables} == {"gpu"}
    config = v41_preset_config("v41-tiny")  # a preset's: the tables made in host memory, the rest on the device
    split = stored_random_tensors(config, 3, torch.float32, device="meta", include_mtp=False,
                                  placement=lambda name: "cpu" if ".engram.embed." in name else "meta")
    table = split["layers.0.engram.embed.weight"]
    assert table.device.type == "cpu" and split["layers.0.attn.wkv.weight"].device.type == "meta"
    whole = stored_random_tensors(config, 3, torch.float32, include_mtp=False)  # the same values as made whole
    assert torch.equal(table, whole["layers.0.engram.embed.weight"])


def _file_mappings(folder) -> list[tuple[int, int]]:
    """The address ranges this process maps from `folder`'s files (Linux's /proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip().startswith(str(folder.resolve())):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_host_engram_tables_kept_as_stored_are_the_checkpoint_files_pages(v41_checkpoint):
    """Engram tables kept in host memory as stored are the checkpoint file's own pages, mapped, never
    copied: every process of a machine that loads the folder (the ranks of expert parallelism) shares
    one copy in the page cache, and only the rows steps read are ever brought in from disk."""
    llm = LLM(v41_checkpoint, engram_tables="host", weight_storage="quantized", max_model_len=128)
    mapped = _file_mappings(v41_checkpoint)
    tables = [llm.model.layers[layer].engram.embed.weight for layer in (0, 4)]
    for table in tables:
        for part in (table.data, table.scale):
            first, last = part.data_ptr(), part.data_ptr() + part.numel() * part.element_size()
            assert any(start <= first and last <= end for start, end in mapped)
    experts = llm.model.layers[1].ffn.experts.w13.data  # stacked across experts: memory of the process's own
    assert not any(start <= experts.data_ptr() < end for start, end in mapped)


def test_a_quantized_checkpoint_missing_a_scale_fails_in_one_line(tmp_path):
    folder = tmp_path / "q"
    assert main(["checkpoint", "create", "--preset", "v41-tiny", "--out", str(folder), "--quantized"]) == 0
    tensors = load_file(folder / "model.safetensors")
    del tensors["layers.3.attn.wkv.scale"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert str(err.value) == "missing tensor layers.3.attn.wkv.scale"


def test_only_v41_presets_quantize(tmp_path, capsys):
    assert main(["checkpoint", "create", "--preset", "tiny", "--out", str(tmp_path / "t"), "--quantized"]) == 2
    assert capsys.readouterr().err == ("error: --quantized writes a family's released formats; preset 'tiny' is a V4 "
                                       "model, which has none\n")
    assert not (tmp_path / "t").exists()


def test_flash_footprint_by_format(tmp_path, capsys):
    """`checkpoint info` of the config-only v41-flash preset: the backbone in the release's formats."""
    assert main(["checkpoint", "create", "--preset", "v41-flash", "--out", str(tmp_path / "f")]) == 0
    parts = footprint(v41_preset_config("v41-flash"))
    experts = 40 * 384 * 3 * 2304 * 5120  # layers x experts x (w1, w2, w3) x elements
    assert parts["routed experts (MXFP4)"] == experts // 2  # two E2M1 codes per byte
    assert parts["Engram tables (FP8)"] == (384006168 + 384016682) * 256
    assert parts["E8M0 scales"] >= experts // 32 + (384006168 + 384016682) * 256 // 32
    capsys.readouterr()
    assert main(["checkpoint", "info", str(tmp_path / "f")]) == 0
    assert "footprint   467.0 GiB in the release's formats (backbone)" in capsys.readouterr().out
