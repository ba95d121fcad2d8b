import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import deepinfer.checkpoint.writer as writer
from deepinfer.recipe.tokenizer import TextTokenizer
from deepinfer.checkpoint import (
    DEFAULT_PRESET,
    CheckpointError,
    content_hash,
    create_checkpoint,
    default_checkpoint,
    expected_tensors,
    inspect_checkpoint,
    load_checkpoint,
    preset_config,
    random_tensors,
    write_weights,
)
from deepinfer.checkpoint.files import weight_files
from deepinfer.checkpoint.hashing import cache_path
from deepinfer.families.tensor_spec import FP32, INDEX, WEIGHT
from deepinfer.families.v41.layout import released_format
from deepinfer.checkpoint.random_init import RandomTensors, random_tensor
from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.families.v4.config import CSA, HCA, SLIDING, ConfigError

transformers = pytest.importorskip("transformers")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_tensors(src: Path, dst: Path, mutate) -> Path:
    """A copy of checkpoint `src` whose tensors went through `mutate(dict)`."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(src / name, dst / name)
    tensors = load_file(src / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def _error(fn, *args) -> str:
    with pytest.raises(CheckpointError) as err:
        fn(*args)
    message = str(err.value)
    assert "\n" not in message
    return message


# -- layout, checked against what transformers writes --------------------------------------------

def _odd_hf_config(**overrides):
    """Every width distinct, so a swapped dimension in the layout cannot go unnoticed."""
    fields = dict(
        vocab_size=300, hidden_size=48, moe_intermediate_size=40, num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
        num_attention_heads=3, head_dim=32, q_lora_rank=24, n_routed_experts=5, num_experts_per_tok=2,
        partial_rotary_factor=0.25, o_groups=3, o_lora_rank=20, sliding_window=16,
        compress_rates={CSA: 4, HCA: 8}, index_n_heads=2, index_head_dim=12, index_topk=8, hc_mult=3,
        max_position_embeddings=512,
    )
    return transformers.DeepseekV4Config(**{**fields, **overrides})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loads_transformers_saved_folder(tmp_path, dtype):
    torch.manual_seed(0)
    transformers.DeepseekV4ForCausalLM(_odd_hf_config()).save_pretrained(tmp_path / "fp32")
    folder = tmp_path / "fp32"
    if dtype == torch.bfloat16:  # from_pretrained keeps the fp32 modules in fp32, as real checkpoints do
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=dtype)
        folder = tmp_path / "bf16"
        model.save_pretrained(folder)
    ckpt = load_checkpoint(folder)
    assert not ckpt.has_mtp
    assert set(ckpt.tensors) == set(expected_tensors(ckpt.config, include_mtp=False))
    for name, spec in expected_tensors(ckpt.config, include_mtp=False).items():
        want = {FP32: torch.float32, INDEX: torch.int64, WEIGHT: dtype}[spec.kind]
        assert ckpt.tensors[name].dtype == want, name
    assert inspect_checkpoint(folder).weight_dtype == str(dtype).removeprefix("torch.")


def test_transformers_loads_tiny_checkpoint(tiny_checkpoint):
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    ours = load_checkpoint(tiny_checkpoint).tensors
    assert torch.equal(model.model.embed_tokens.weight, ours["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, ours["head.weight"])


def test_tiny_random_network_is_healthy_and_decisive(tiny_checkpoint):
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ids = torch.randint(16, 1024, (2, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.isfinite(logits).all()
        std = logits.std(-1)
        assert 1 < std.min() and std.max() < 5
        top2 = logits.topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).median() > 1e-2
        out = model.generate(ids[:1, :8], max_new_tokens=64, do_sample=False)
    assert len(set(out[0, 8:].tolist())) >= 8


# -- random weights -------------------------------------------------------------------------------

def test_random_tensors_are_deterministic_and_seeded():
    config = preset_config("tiny")
    a = random_tensors(config, 0, torch.float32)
    b = random_tensors(config, 0, torch.float32)
    assert a.keys() == b.keys() == expected_tensors(config, include_mtp=True).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = random_tensors(config, 1, torch.float32, include_mtp=False)
    assert not any(k.startswith("mtp.") for k in c)
    assert not torch.equal(a["head.weight"], c["head.weight"])
    # a tensor does not depend on which others were generated, or in what order
    name = "model.layers.2.attn.compressor.wkv.weight"
    spec = expected_tensors(config, include_mtp=False)[name]
    assert torch.equal(random_tensor(config, 0, name, spec, torch.float32), a[name])


def test_random_tensor_kinds_and_scales():
    config = preset_config("tiny")
    specs = expected_tensors(config, include_mtp=True)
    t = dict(RandomTensors(config, 3, torch.bfloat16))
    for name, spec in specs.items():
        assert t[name].shape == spec.shape
        assert t[name].dtype == {WEIGHT: torch.bfloat16, FP32: torch.float32, INDEX: torch.int64}[spec.kind]
    norm = t["model.layers.0.attn_norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and norm.std() > 0.01
    assert t["model.layers.1.attn.compressor.ape"].abs().max() > 0
    table = t["model.layers.0.ffn.gate.tid2eid"]
    assert table.shape == (1024, 2) and 0 <= table.min() and table.max() < 16
    assert all(len(set(row)) == 2 for row in table.tolist())
    assert len(set(table.flatten().tolist())) == 16
    wq = t["model.layers.0.attn.wq_a.weight"].float()
    assert abs(wq.std().item() * 128**0.5 - 1) < 0.05


# -- writing ---------------------------------------------------------------------------------------

def test_created_checkpoint_contents(tiny_checkpoint):
    names = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"]  # the hash cache lives elsewhere
    assert json.loads((tiny_checkpoint / "config.json").read_text()) == preset_config("tiny").to_dict()
    ckpt = load_checkpoint(tiny_checkpoint)
    assert ckpt.has_mtp and ckpt.tokenizer_path == tiny_checkpoint / "tokenizer.json"
    assert ckpt.config == preset_config("tiny")
    want = random_tensors(preset_config("tiny"), 0, torch.float32)
    assert ckpt.tensors.keys() == want.keys()
    assert all(torch.equal(ckpt.tensors[k], want[k]) for k in want)


def test_create_refuses_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    assert _error(create_checkpoint, "tiny", tmp_path / "x", 0) == (
        f"{tmp_path / 'x'}: already exists and is not an empty folder; refusing to overwrite")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_create_into_empty_folder_and_unknown_preset(tmp_path):
    (tmp_path / "empty").mkdir()
    create_checkpoint("tiny", tmp_path / "empty", seed=0)
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert _error(create_checkpoint, "huge", tmp_path / "y", 0) == (
        "unknown preset 'huge'; choose one of tiny, small, flash-4l, flash, v41-tiny, v41-small, v41-flash-5l, v41-flash, "
        "v41-flash-ep8-rank")


def test_interrupted_create_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        create_checkpoint("tiny", tmp_path / "out", seed=0)
    assert list(tmp_path.iterdir()) == []


def test_default_checkpoint_race(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path / "home"))
    real = writer.write_weights
    raced = []

    def write_while_another_process_wins(*args, **kwargs):
        if not raced:  # the "other process" completes its create while we are mid-way through ours
            raced.append(True)
            create_checkpoint(DEFAULT_PRESET, writer.default_checkpoint_path(), seed=0, quantized=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_weights", write_while_another_process_wins)
    path = default_checkpoint()
    assert path == writer.default_checkpoint_path() and path.parent == tmp_path / "home" and raced
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["content-hashes", path.name]  # loser cleaned up
    assert load_checkpoint(path).config == released_format(preset_config(DEFAULT_PRESET))
    assert default_checkpoint() == path


def test_flash_preset_is_config_only(tmp_path, capsys):
    assert main(["checkpoint", "create", "--preset", "flash", "--out", str(tmp_path / "flash")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "weights not written" in out
    assert sorted(p.name for p in (tmp_path / "flash").iterdir()) == ["config.json", "tokenizer.json"]
    info = inspect_checkpoint(tmp_path / "flash")
    assert not info.has_weights and info.config.num_hidden_layers == 43 and info.weight_dtype == "bfloat16"
    assert _error(load_checkpoint, tmp_path / "flash") == f"{tmp_path / 'flash'}: no *.safetensors weight files"


# -- content hash ----------------------------------------------------------------------------------

def test_content_hash_ignores_sharding(tiny_checkpoint, tmp_path):
    ckpt = load_checkpoint(tiny_checkpoint)
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", folder)
    digest = write_weights(folder, ckpt.tensors, max_shard_bytes=1 << 20)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 5 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert digest == ckpt.content_hash == content_hash(folder)
    cache_path(weight_files(folder)).unlink()
    resharded = load_checkpoint(folder)
    assert resharded.content_hash == ckpt.content_hash
    assert all(torch.equal(resharded.tensors[k], v) for k, v in ckpt.tensors.items())


def test_content_hash_changes_with_one_byte(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    original = content_hash(folder)
    path = folder / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert content_hash(folder) != original
    assert load_checkpoint(folder).content_hash == content_hash(folder)


def _forge_cache(folder: Path, digest: str) -> None:
    """Put `digest` in the cache entry of the folder's weights as they are now, dated after them (the
    cache ignores entries no older than the files they describe)."""
    path = cache_path(weight_files(folder))
    path.write_text(json.dumps({**json.loads(path.read_text()), "sha256": digest}))
    later = max(p.stat().st_ctime_ns for p in folder.iterdir()) + 10**9
    os.utime(path, ns=(later, later))


def test_content_hash_cache_is_used_and_invalidated(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    real = content_hash(folder)
    _forge_cache(folder, "f" * 64)
    assert content_hash(folder) == "f" * 64  # served from the cache, no tensor read
    assert load_checkpoint(folder).content_hash == "f" * 64
    path = folder / "model.safetensors"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # any change of a key invalidates
    assert content_hash(folder) == real
    # rewriting a file and restoring its mtime is still caught (ctime changes)
    _forge_cache(folder, "e" * 64)
    assert content_hash(folder) == "e" * 64
    st = path.stat()
    path.write_bytes(path.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_hash(folder) == real


def test_tampered_weights_cannot_keep_the_original_hash(tiny_checkpoint, tmp_path, capsys):
    """Whoever can write the checkpoint folder cannot make the engine record its original hash: the
    cache is not in the folder, and a rewritten file no longer matches its entry (ctime, inode)."""
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    original = content_hash(folder)
    path = folder / "model.safetensors"
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime as before
    (folder / ".content-hash.json").write_text(json.dumps({"version": 1, "sha256": original}))
    tampered = content_hash(folder)
    assert tampered != original and load_checkpoint(folder).content_hash == tampered
    _forge_cache(folder, original)  # a forged entry in the user's own cache is still caught by --verify
    assert main(["checkpoint", "info", str(folder)]) == 0
    assert f"content     {original}\n" in capsys.readouterr().out
    assert main(["checkpoint", "info", str(folder), "--verify"]) == 0
    assert f"content     {tampered} (hashed from the weights' bytes)\n" in capsys.readouterr().out


# -- validation errors -----------------------------------------------------------------------------

def test_missing_folder_and_config(tmp_path):
    assert _error(load_checkpoint, tmp_path / "nope") == f"{tmp_path / 'nope'}: checkpoint folder not found"
    with pytest.raises(ConfigError) as err:
        load_checkpoint(tmp_path)
    assert str(err.value) == f"{tmp_path / 'config.json'}: not found (is '{tmp_path}' a DeepSeek-V4 checkpoint folder?)"


def test_bad_config_field(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    raw = json.loads((folder / "config.json").read_text())
    raw["o_groups"] = "2"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_checkpoint(folder)
    assert str(err.value) == f"{folder / 'config.json'}: field 'o_groups' must be int, got str '2'"


def test_no_safetensors(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    (folder / "model.safetensors").unlink()
    assert _error(load_checkpoint, folder) == f"{folder}: no *.safetensors weight files"


@pytest.mark.parametrize("keep", [100, -100])
def test_truncated_safetensors(tiny_checkpoint, tmp_path, keep):
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    path = folder / "model.safetensors"
    os.truncate(path, keep if keep > 0 else path.stat().st_size + keep)
    prefix = f"{path}: corrupt or truncated safetensors file ("
    assert _error(load_checkpoint, folder).startswith(prefix)
    assert _error(content_hash, folder).startswith(prefix)


def test_garbage_safetensors(tiny_checkpoint, tmp_path):
    folder = _copy(tiny_checkpoint, tmp_path / "c")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file at all" * 4)
    assert _error(load_checkpoint, folder).startswith(f"{folder / 'model.safetensors'}: corrupt or truncated")


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize("mutate,message", [
    (_drop("model.layers.0.attn.wq_a.weight"), "missing tensor model.layers.0.attn.wq_a.weight"),
    (_set("model.layers.0.attn.extra.weight", torch.zeros(2)), "unexpected tensor model.layers.0.attn.extra.weight"),
    (_set("model.layers.1.attn.wkv.weight", torch.zeros(32, 128)),
     "model.layers.1.attn.wkv.weight: shape (32, 128) does not match config (64, 128)"),
    (_set("head.weight", torch.zeros(1024, 128, dtype=torch.bfloat16)),
     "head.weight: dtype bfloat16 does not match checkpoint dtype float32"),
    (_set("model.norm.weight", torch.ones(128, dtype=torch.bfloat16)),
     "model.norm.weight: dtype bfloat16, expected float32"),
    (_set("model.layers.0.ffn.gate.tid2eid", torch.zeros(1024, 2, dtype=torch.int32)),
     "model.layers.0.ffn.gate.tid2eid: dtype int32, expected int64"),
    (_set("model.layers.0.ffn.gate.tid2eid", torch.full((1024, 2), 16)),
     "model.layers.0.ffn.gate.tid2eid: expert id 16 out of range [0, 16)"),
])
def test_bad_tensors(tiny_checkpoint, tmp_path, mutate, message):
    folder = _with_tensors(tiny_checkpoint, tmp_path / "c", mutate)
    assert _error(load_checkpoint, folder) == message


def _as_bfloat16(src: Path, dst: Path, keep_float32: tuple[str, ...] = ()) -> Path:
    """A copy of `src` declared and stored as bfloat16, except the weights in `keep_float32`, stored as
    float32 (with the same bfloat16 values, widened exactly)."""
    layout = expected_tensors(preset_config("tiny"), include_mtp=True)

    def narrow(tensors: dict) -> None:
        for name, tensor in tensors.items():
            if layout[name].kind == WEIGHT:
                narrow_value = tensor.to(torch.bfloat16)
                tensors[name] = narrow_value.float() if name in keep_float32 else narrow_value

    folder = _with_tensors(src, dst, narrow)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return folder


def test_weights_stored_wider_than_the_checkpoint_dtype_load_and_are_recorded(tiny_checkpoint, tmp_path):
    """A bfloat16 checkpoint that stores some weights as float32 (NeMo's V4.1 export does) loads; the
    manifest names them; with the same values the outputs are the same bits as the all-bfloat16 one."""
    narrow = _as_bfloat16(tiny_checkpoint, tmp_path / "bf16")
    mixed = _as_bfloat16(tiny_checkpoint, tmp_path / "mixed", keep_float32=("head.weight", "model.embed_tokens.weight"))
    outputs = {}
    for folder in (narrow, mixed):
        llm = LLM(folder)
        outputs[folder] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logprobs=1))[0]
    assert outputs[narrow].token_ids == outputs[mixed].token_ids and outputs[narrow].logprobs == outputs[mixed].logprobs
    assert llm.stored_formats == {"weights": "bfloat16", "float32_weights": "head.weight, model.embed_tokens.weight"}
    assert load_checkpoint(narrow).formats == {"weights": "bfloat16"}


def test_partial_mtp_set(tiny_checkpoint, tmp_path):
    folder = _with_tensors(tiny_checkpoint, tmp_path / "c", _drop("mtp.0.confidence.bias"))
    n = sum(k.startswith("mtp.") for k in expected_tensors(preset_config("tiny"), include_mtp=True))
    assert _error(load_checkpoint, folder) == (
        f"partial MTP set: {n - 1} of {n} mtp.* tensors present, missing mtp.0.confidence.bias")


def test_no_mtp_loads_without_draft(tiny_checkpoint, tmp_path):
    def drop_mtp(t):
        for k in [k for k in t if k.startswith("mtp.")]:
            del t[k]

    ckpt = load_checkpoint(_with_tensors(tiny_checkpoint, tmp_path / "c", drop_mtp))
    assert not ckpt.has_mtp and not any(k.startswith("mtp.") for k in ckpt.tensors)


def test_index_naming_missing_shard(tiny_checkpoint, tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", folder)
    write_weights(folder, load_checkpoint(tiny_checkpoint).tensors, max_shard_bytes=4 << 20)
    (folder / "model-00002-of-00003.safetensors").unlink()
    assert _error(load_checkpoint, folder) == (
        f"{folder / 'model.safetensors.index.json'}: names model-00002-of-00003.safetensors, which does not exist")


# -- CLI -------------------------------------------------------------------------------------------

def test_cli_create_and_info(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["checkpoint", "create", "--preset", "tiny", "--out", str(out), "--seed", "5"]) == 0
    created = capsys.readouterr().out
    digest = content_hash(out)
    assert created.startswith(f"{out}: preset tiny, seed 5, ") and created.count("\n") == 1
    assert created.endswith(f"M parameters (float32), content hash {digest}\n")
    assert main(["checkpoint", "info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "sliding_attention x1, compressed_sparse_attention x2, heavily_compressed_attention x1" in info
    assert "hash_moe x2, moe x2" in info and "routed experts" in info
    assert f"content     {digest}" in info and "mtp         present" in info and "tokenizer   present" in info


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["checkpoint", "info", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'}: checkpoint folder not found\n"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert main(["checkpoint", "create", "--preset", "tiny", "--out", str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("argv", [["--help"], ["checkpoint", "--help"], ["checkpoint", "create", "--help"],
                                  ["checkpoint", "info", "--help"]])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    assert "usage: deepinfer" in capsys.readouterr().out


# -- the small preset (slow; tiny covers the same properties) ---------------------------------------

@pytest.mark.slow
def test_small_preset_loads_in_transformers_and_is_healthy(tmp_path):
    folder = create_checkpoint("small", tmp_path / "small", seed=0)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = torch.randint(16, 8192, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.eval()(ids).logits
        assert torch.isfinite(logits).all() and 1 < logits.std(-1).min() and logits.std(-1).max() < 5
        out = model.generate(ids[:, :8], max_new_tokens=64, do_sample=False)
    assert len(set(out[0, 8:].tolist())) >= 8


def test_a_terminated_create_leaves_no_partial_checkpoint(tmp_path):
    """SIGTERM (a job scheduler's kill) mid-write unwinds like Ctrl-C: the hidden folder being written
    is removed, nothing appears at --out, and the exit status is 128 + SIGTERM."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "ck"
    command = [sys.executable, "-c", "import sys; from deepinfer.harness.cli import main; sys.exit(main(sys.argv[1:]))",
               "checkpoint", "create", "--preset", "small", "--out", str(out), "--seed", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer never started"
        time.sleep(0.02)
    time.sleep(0.2)  # some shards written
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read().decode()
    assert list(tmp_path.iterdir()) == []


def test_default_checkpoint_path_follows_the_tokenizer(monkeypatch):
    """A default built under another tokenizer is not taken for the current one."""
    before = writer.default_checkpoint_path()
    other = TextTokenizer(writer.preset_tokenizer(None, 512).text, "another tokenizer")
    monkeypatch.setattr(writer, "preset_tokenizer", lambda encoding, vocab_size: other)
    assert writer.default_checkpoint_path() != before
