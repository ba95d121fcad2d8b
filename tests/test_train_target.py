"""`benchmarks/train_target.py` on `v41-tiny`, on the CPU, over a handful of standard-library files and a
few steps: training lowers the loss; the same seed writes the same checkpoint bits; the exported folder
serves like NeMo's trained model (prompt logprobs within the oracle tests' tolerance, greedy tokens NeMo's
argmax) and speculates with the token ids of plain decoding; NeMo's Engram hashes agree with the engine's
when the vocabulary outgrows the tokenizer (v41-small); held-out files never reach the training windows;
bad flags are one-line errors with exit code 2."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import content_hash, load_checkpoint
from deepinfer.families.v41.engram import vocabulary_map
from deepinfer.families.v41.layout import is_optional
from deepinfer.families.v41.presets import v41_preset_config
from deepinfer.recipe.tokenizer import preset_tokenizer

SPEC = importlib.util.spec_from_file_location("train_target",
                                              Path(__file__).parents[1] / "benchmarks" / "train_target.py")
train_target = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = train_target  # its dataclasses look their module up
SPEC.loader.exec_module(train_target)

PRESET = "v41-tiny"
SEQ_LEN = 48
SHARE = 0.05
TOLERANCE = 1e-4  # tests/test_oracle_v41.py's, without the cache quantize-dequantize on either side
GREEDY_TOKENS = 6
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_files(held_out: bool, count: int) -> list[str]:
    """The first `count` files of 2 to 12 KB on the given side of the split, in sorted order."""
    root = train_target.stdlib_root()
    return [name for name in train_target.corpus_files()
            if train_target.is_held_out(name, SHARE) == held_out
            and 2_000 < (root / name).stat().st_size < 12_000][:count]


@dataclass
class Trained:
    config: object
    tokenizer: object
    corpus: object
    model: torch.nn.Module
    folder: Path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    torch.set_num_threads(1)
    config = v41_preset_config(PRESET)
    tokenizer = preset_tokenizer("v41", config.vocab_size)
    files = sorted(small_files(False, 3) + small_files(True, 2))
    corpus = train_target.load_corpus(tokenizer, files, SEQ_LEN, SHARE)
    model = train_target.build_model(config, tokenizer, seed=0)
    train_target.train(model, train_target.batches(corpus.train, 2, seed=0), train_target.TrainSettings(2), CPU)
    folder = tmp_path_factory.mktemp("trained") / "checkpoint"
    tensors = train_target.exported_tensors(model, config, seed=0)
    train_target.write_checkpoint(folder, config, tokenizer, tensors, quantized=False)
    return Trained(config, tokenizer, corpus, model, folder)


def test_training_on_one_batch_lowers_its_loss(trained):
    model = train_target.build_model(trained.config, trained.tokenizer, seed=1)
    batch = trained.corpus.train[:2]
    before = train_target.mean_loss(model, batch, CPU, 2)
    curve = train_target.train(model, itertools.repeat(batch), train_target.TrainSettings(3, log_every=1), CPU)
    assert [point["step"] for point in curve] == [1, 2, 3]
    assert train_target.mean_loss(model, batch, CPU, 2) < before - 0.1


def test_held_out_files_never_reach_the_training_windows(trained):
    corpus = trained.corpus
    assert corpus.train_files and corpus.held_out_files
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    assert all(train_target.is_held_out(name, SHARE) for name in corpus.held_out_files)
    assert not any(train_target.is_held_out(name, SHARE) for name in corpus.train_files)
    root = train_target.stdlib_root()
    texts = [(root / name).read_text(encoding="utf-8") for name in corpus.train_files]
    docs = train_target.tokenize(trained.tokenizer, texts)
    assert torch.equal(corpus.train, train_target.pack(docs, SEQ_LEN))  # the training windows: train files alone
    # a file's side depends on its path alone, not on which other files a run reads
    alone = train_target.load_corpus(trained.tokenizer, corpus.held_out_files[:1], SEQ_LEN, SHARE)
    assert (alone.train_files, alone.held_out_files) == ([], corpus.held_out_files[:1])


def test_distillation_prompts_come_from_training_files_spread_over_the_list(trained):
    root = train_target.stdlib_root()
    texts = {name: (root / name).read_text(encoding="utf-8") for name in trained.corpus.train_files}
    whole = train_target.distill_corpus(trained.corpus, budget=10**9)
    assert whole == "\n".join(texts.values())
    part = train_target.distill_corpus(trained.corpus, budget=len(whole.encode()) // 3)
    assert part == "\n".join(list(texts.values())[::3])
    assert not any((root / name).read_text(encoding="utf-8") in whole for name in trained.corpus.held_out_files)


def test_nemo_folds_a_vocabulary_larger_than_the_tokenizer_as_the_engine_does():
    """v41-small's tokenizer has fewer ids than its vocabulary: NeMo's Engram token map over
    `ModelVocabulary` is the engine's `vocabulary_map`, so NeMo's hashes are the engine's."""
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map

    config = v41_preset_config("v41-small")
    tokenizer = preset_tokenizer("v41", config.vocab_size)
    assert tokenizer.vocab_size < config.vocab_size
    mapping, size = _compressed_token_map(train_target.ModelVocabulary(tokenizer, config.vocab_size))
    ours, our_size = vocabulary_map(tokenizer.backend, config.vocab_size)
    assert (list(mapping), size) == (ours.tolist(), our_size) and size == config.engram_compressed_vocab_size


def _nemo_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """NeMo's logits without the cache quantize-dequantize (as tests/test_oracle_v41.py runs it)."""
    from nemo_automodel.components.models.deepseek_v41 import attention

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(attention, "quantize_cache", lambda values, **_: values)
        return model(torch.tensor([ids])).logits[0].float()


def test_the_exported_checkpoint_serves_like_nemos_trained_model(trained):
    prompt = train_target.prompts_from(trained.corpus.held_out_docs, 1, 40)[0]
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, prompt_logprobs=True)
    out = LLM(trained.folder, max_model_len=128, cache_qdq=False).generate([prompt], params)[0]
    logits = _nemo_logits(trained.model, prompt)
    want = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    drift = (torch.tensor(out.prompt_logprobs) - want).abs().max().item()
    assert drift <= TOLERANCE, f"prompt logprobs {drift:.2e} from NeMo"
    continued = _nemo_logits(trained.model, prompt + out.token_ids[:-1])[len(prompt) - 1:]
    assert continued.argmax(dim=-1).tolist() == out.token_ids
    stored = load_checkpoint(trained.folder).tensors
    exported = trained.model.state_dict_adapter.to_hf(trained.model.state_dict())
    assert {name for name in stored if not is_optional(name)} == {name for name in exported if not is_optional(name)}


def test_a_quantized_export_loads_and_speculation_keeps_plain_decodings_tokens(trained, tmp_path):
    tensors = train_target.exported_tensors(trained.model, trained.config, seed=0)
    folder = tmp_path / "quantized"
    digest = train_target.write_checkpoint(folder, trained.config, trained.tokenizer, tensors, quantized=True)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"
    assert digest == content_hash(folder, trust_cache=False) != content_hash(trained.folder)
    prompts = train_target.prompts_from(trained.corpus.held_out_docs, 2, 24)
    measured = train_target.speculation(folder, prompts, "cpu", max_tokens=8, draft_tokens=5)
    assert measured["identical"]
    assert measured["counters"]["drafted"] > 0 and measured["counters"]["verify_chunks"] > 0
    rows = list(train_target.speed(folder, prompts, "cpu", "float32", [2], [0.7], max_tokens=6, draft_tokens=3))
    assert [(r["speculation"], r.get("verify_policy")) for r in rows] == [
        ("off", None), ("dspark-3", "fixed"), ("dspark-3", "throughput"), ("off", None)]
    assert rows[3]["again"] and rows[3]["bitwise_equal"]
    assert all(r["batch"] == 2 and r["temperature"] == 0.7 and r["tokens_per_s"] > 0 for r in rows)
    fixed = rows[1]
    assert fixed["bitwise_equal"] and rows[2]["bitwise_equal"]
    assert fixed["drafted"] > 0 and fixed["verify_chunks"] > 0 and fixed["verify_lengths"]
    assert sum(fixed["verify_lengths"].values()) == fixed["verify_chunks"]
    # the device clock splits each step: the drafter ran in the speculating steps, never with speculation off
    assert fixed["device_ms"]["with_drafter"]["drafter_median_ms"] > 0
    assert set(rows[0]["device_ms"]) == {"without_drafter"} and rows[0]["device_ms"]["without_drafter"]["steps"] > 0


def _argv(tmp_path: Path, name: str, *more: str) -> list[str]:
    return ["--preset", PRESET, "--device", "cpu", "--steps", "2", "--batch", "2", "--seq-len", str(SEQ_LEN),
            "--max-files", "12", "--held-out-share", "0.3", "--eval-windows", "2",
            "--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"{name}.json"), *more]


def test_the_same_seed_writes_the_same_checkpoint(tmp_path):
    assert train_target.main(_argv(tmp_path, "first")) == 0
    assert train_target.main(_argv(tmp_path, "second")) == 0
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    assert first["checkpoint"]["content_hash"] == second["checkpoint"]["content_hash"]
    assert content_hash(tmp_path / "second", trust_cache=False) == first["checkpoint"]["content_hash"]
    assert first["train_loss"] == [{**point, "seconds": p["seconds"]} for point, p in
                                   zip(second["train_loss"], first["train_loss"])]
    assert first["held_out_loss"] == second["held_out_loss"]
    assert first["corpus"]["held_out_files"] > 0 and first["command"].endswith("--out first.json")
    # a later run measures the trained target without training it again, on a copy checked against it
    reuse = _argv(tmp_path, "reused", "--trained", str(tmp_path / "first"), "--spec-prompts", "1", "--max-tokens", "4",
                  "--speed-batches")
    assert train_target.main(reuse) == 0
    reused = json.loads((tmp_path / "reused.json").read_text())
    assert reused["trained"] == {"by": first["command"], "on": "cpu", "folder": "first", "drafter": "as trained",
                                 "content_hash": first["checkpoint"]["content_hash"]}
    assert reused["train_loss"] == first["train_loss"] and reused["speculation"]["identical"]
    assert reused["command"].endswith("--speed-batches") and "speed" not in reused


def test_a_trained_target_is_reused_only_as_it_was_trained(tmp_path, capsys):
    assert train_target.main(_argv(tmp_path, "first")) == 0
    capsys.readouterr()
    few = ("--spec-prompts", "1", "--speed-batches")
    for folder, more, message in [
        ("first", ("--seed", "1"), "trained with seed 0, not 1"),
        ("missing", (), "no training record train_target.json"),
    ]:
        assert train_target.main(_argv(tmp_path, f"to-{folder}", "--trained", str(tmp_path / folder), *more, *few)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
    weights = next((tmp_path / "first").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert train_target.main(_argv(tmp_path, "to-changed", "--trained", str(tmp_path / "first"), *few)) == 2
    assert "is neither the trained one nor a distillation's" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (("--steps", "0"), "argument --steps: must be > 0"),
    (("--preset", "v41-huge"), "argument --preset: invalid choice"),
    (("--out", "/nonexistent-folder/x.json"), "--out: folder /nonexistent-folder does not exist"),
    (("--speed-temperatures", "-1"), "--speed-temperatures must be >= 0, got [-1.0]"),
    (("--speed-batches", "0"), "argument --speed-batches: must be > 0, got 0"),
    (("--distill-prompts", "0"), "argument --distill-prompts: must be > 0, got 0"),
    (("--draft-tokens", "6"), "--draft-tokens 6: v41-tiny's DSpark drafts at most 5 a step"),
])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, change, message):
    argv = _argv(tmp_path, "bad")
    if change[0] in argv:
        argv[argv.index(change[0]) + 1] = change[1]
    else:
        argv += change
    with pytest.raises(SystemExit) as exit_:
        train_target.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "bad").exists()
