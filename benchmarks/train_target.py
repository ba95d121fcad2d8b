"""Train a small DeepSeek-V4.1 target on the Python standard library's sources, so drafters have something to predict.

    python benchmarks/train_target.py --preset v41-small --device cuda --steps 350 --batch 64 \
        --checkpoint runs/v41-small-stdlib --out benchmarks/results/train_target_v41-small_h200.json
    python benchmarks/train_target.py --preset v41-small --device cuda --steps 350 --batch 64 --quantized \
        --distill-steps 300 --checkpoint runs/v41-small-stdlib-q \
        --out benchmarks/results/train_target_v41-small_q_h200.json
    python benchmarks/train_target.py --preset v41-tiny --device cpu --steps 20 --batch 4 --seq-len 128 \
        --max-files 60 --held-out-share 0.2 --checkpoint runs/v41-tiny-stdlib --out train_target_v41-tiny_cpu.json

Random weights make every speculative drafter useless (issue 34, item 3): nothing they draft holds. This
trains a preset's model on text every machine has without downloads, the standard library's `*.py` files
(`sysconfig`'s stdlib folder, site-packages excluded, sorted by relative path; files that are not UTF-8
are skipped). A file is held out when the SHA-256 of its relative path falls in the lowest
`--held-out-share` of the hash range, so its split depends on its path alone, never on which other files
a run reads: held-out files are never trained on, and give the held-out loss and the speculation prompts.

1. the model is NeMo AutoModel's V4.1 port (our oracle) for the preset's text config with torch backends,
   initialised from `--seed` on the CPU (the same weights whatever the device), then moved to `--device`;
2. each file is tokenized by the preset's tokenizer as BOS + text + EOS; the train files' stream is cut
   into windows of `--seq-len` tokens, and each step trains on `--batch` of them in a seeded order (a new
   permutation per pass) with AdamW (linear warmup, cosine decay to a tenth, gradient norm clipped to 1),
   in fp32 on the CPU and under bf16 autocast on CUDA (fp32 master weights), with PyTorch's deterministic
   algorithms on (ops that have none are recorded, not fatal). NeMo freezes the CSA2 indexers (it has no
   indexer loss), so they keep their initial weights;
3. NeMo's state-dict adapter exports the weights in the released names; the backbone's (what
   `expected_tensors_v41` lists; the vision tower and image-token biases are dropped) are written with
   DSpark draft layers of the writer's seeded random init (`checkpoint create`'s), fp32 or with
   `--quantized` in the release's formats (`layout.quantize`: FP8 dense weights and Engram tables, MXFP4
   experts), beside config.json and the preset's tokenizer.json: a folder `LLM(folder)` loads;
4. with `--distill-steps N`, `deepinfer dspark distill` (the library's `distill`) trains the draft layers
   on the target's own generations (continuing `--distill-prompts` windows of training files' text,
   `distill_corpus`), then greedy requests on held-out prompts run with `speculation="dspark"`
   and without: their token ids must be identical (the engine's contract; the script fails otherwise), and
   the scheduler's counters give the share of drafts kept and the mean accepted length per verify step;
5. then decode speed (`--speed-batches`, `--speed-temperatures`): per batch size B and temperature, B
   held-out prompts of `--prompt-tokens` tokens and `--speed-tokens` new tokens each (seeded sampling
   above temperature 0), timed without speculation and with DSpark at `--draft-tokens` drafts under each
   `verify_policy`, side by side in one engine's weights (`gpu_speculation.timed`: fresh engines, warmed
   up first, the default setup otherwise: CUDA graphs and async scheduling on a GPU, in `--dtype`):
   tokens per second, the speed-up over off, drafts kept, the mean accepted length, the verify lengths
   chosen, and whether the outputs' bits equal those of speculation off (they must).

On one H100, v41-small at `--batch 64` (32K tokens a step) took about 0.72 s a step once warm and
`--batch 16` about 0.62 s (short probes: the step is mostly launch overhead, so bigger batches cost
little more), and the same command wrote the same checkpoint bits twice; 350 steps at `--batch 64` is
about 4 minutes of training and 11M tokens, some 3 passes over a Debian Python 3.12 stdlib (3.7M training
tokens; sysconfig's stdlib differs between machines and Python versions, the record hashes it).

The JSON at `--out` records the command, device, versions, corpus, settings, the train-loss curve, the
held-out loss before and after training, the checkpoint's content hash and the wall time; the training's
part of it is also kept in the checkpoint folder (`train_target.json`). With `--trained FOLDER` a run
skips training and works on a copy of a folder an earlier run wrote (checked against that record's
content hash, or a later distillation's): it distills its drafter again, or with `--distill-steps 0`
measures the drafter as it is, so a device lease too short for training, distillation and the speed
runs together can split them over calls. `--speed-policies` picks the verify policies timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import secrets
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's compiled helpers: eager is deterministic and starts at once
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it before CUDA starts

import torch
from torch import nn

from deepinfer import LLM, SamplingParams, __version__
from deepinfer.checkpoint.files import weight_files
from deepinfer.checkpoint.hashing import content_hash, store_hash
from deepinfer.checkpoint.random_init import RandomTensors
from deepinfer.checkpoint.writer import write_weights
from deepinfer.cli import EXIT_USER_ERROR, OneLineErrors
from deepinfer.families.v41.config import V41Config
from deepinfer.families.v41.dspark_distill import RECORD_NAME as DISTILL_RECORD, DistillSettings, distill
from deepinfer.families.v41.engram import vocabulary_map
from deepinfer.families.v41.layout import expected_tensors_v41, is_draft_tensor, quantize
from deepinfer.families.v41.presets import V41_CONFIG_ONLY, V41_PRESETS, v41_preset_config
from deepinfer.recipe.tokenizer import TextTokenizer, preset_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling benchmarks, however it was loaded
from gpu_speculation import clock_figures, timed  # noqa: E402

PRESETS = tuple(p for p in V41_PRESETS if p not in V41_CONFIG_ONLY)
EXCLUDED_DIRS = ("site-packages", "dist-packages")
WARMUP_SHARE = 0.05  # linear warmup over this share of the steps, then a cosine to FINAL_LR_SHARE of the peak
FINAL_LR_SHARE = 0.1
WEIGHT_DECAY = 0.1  # on matrices and tables; norms, biases and mixing scalars get none
GRAD_CLIP = 1.0
TRAIN_RECORD = "train_target.json"  # the training's record, kept in the checkpoint folder for `--trained`
DISTILL_CORPUS_BYTES = 2_000_000  # of training files' text for distillation's prompts
# the scheduler's speculation counters (the names `harness.run_writer` records them under)
COUNTERS = {"drafted": "num_drafted", "drafts_kept": "num_draft_kept", "verify_chunks": "num_verify_chunks",
            "rollbacks": "num_rollbacks", "speculating_steps": "num_speculating_steps", "probes": "num_probes"}


class TrainError(ValueError):
    """Settings this run cannot train with (reported in one line, exit 2)."""


# -- corpus -----------------------------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None, max_files: int | None = None) -> list[str]:
    """The standard library's `*.py` files as paths relative to `root` (the stdlib by default), sorted,
    site-packages excluded; the first `max_files` of them when given."""
    root = root or stdlib_root()
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_DIRS]  # not walked at all
        files += [(Path(folder) / name).relative_to(root).as_posix() for name in names if name.endswith(".py")]
    files.sort()
    return files[:max_files] if max_files is not None else files


def is_held_out(path: str, share: float) -> bool:
    """Whether the file at relative `path` belongs to the evaluation split: by its path's hash alone."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") < share * 2**64


@dataclass
class Corpus:
    """The token streams of a split: `train` and `held_out` windows [N, seq_len], the files each came
    from, each held-out file's tokens (for prompts), and what was read."""

    train_files: list[str]
    held_out_files: list[str]
    train: torch.Tensor
    held_out: torch.Tensor
    held_out_docs: list[list[int]]
    skipped: list[str]  # not UTF-8
    sha256: str  # of every read file's relative path and bytes, in order
    train_tokens: int
    held_out_tokens: int


def distill_corpus(corpus: Corpus, budget: int = DISTILL_CORPUS_BYTES, root: Path | None = None) -> str:
    """Training files' text, every n-th file of the sorted list so that about `budget` bytes come from all
    over it: distillation's prompts (the bundled English story would teach the drafter a code model's
    continuations of prose; the held-out files stay the speed runs' prompts alone)."""
    root = root or stdlib_root()
    sizes = sum((root / name).stat().st_size for name in corpus.train_files)
    step = max(1, math.ceil(sizes / budget))
    return "\n".join((root / name).read_text(encoding="utf-8") for name in corpus.train_files[::step])


def tokenize(tokenizer: TextTokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as BOS + its tokens + EOS."""
    encoded = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    return [[tokenizer.bos_id, *e.ids, tokenizer.eos_id] for e in encoded]


def pack(docs: list[list[int]], seq_len: int) -> torch.Tensor:
    """The documents' concatenation cut into consecutive windows of `seq_len` tokens (the remainder dropped)."""
    stream = torch.tensor([t for doc in docs for t in doc], dtype=torch.long)
    count = len(stream) // seq_len
    return stream[:count * seq_len].view(count, seq_len)


def load_corpus(tokenizer: TextTokenizer, files: list[str], seq_len: int, held_out_share: float,
                root: Path | None = None) -> Corpus:
    root = root or stdlib_root()
    digest = hashlib.sha256()
    texts: dict[str, str] = {}
    skipped = []
    for name in files:
        data = (root / name).read_bytes()
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(name)
            continue
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    train_files = [n for n in texts if not is_held_out(n, held_out_share)]
    held_out_files = [n for n in texts if is_held_out(n, held_out_share)]
    train_docs = tokenize(tokenizer, [texts[n] for n in train_files])
    held_out_docs = tokenize(tokenizer, [texts[n] for n in held_out_files])
    return Corpus(train_files, held_out_files, pack(train_docs, seq_len), pack(held_out_docs, seq_len), held_out_docs,
                  skipped, digest.hexdigest(), sum(map(len, train_docs)), sum(map(len, held_out_docs)))


def batches(windows: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """`batch` windows at a time, in a seeded order: a fresh permutation per pass over the windows (a
    batch never spans two passes)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=generator)
        for start in range(0, len(order) - batch + 1, batch):
            yield windows[order[start:start + batch]]


# -- model ------------------------------------------------------------------------------------------------------

class ModelVocabulary:
    """What NeMo's Engram hash reads of a tokenizer (`len` and `backend_tokenizer.decode / id_to_token`),
    over the model's vocabulary: a preset's tokenizer can be smaller than its vocabulary, and
    `engram.vocabulary_map` gives each id past it a compressed id of its own, after the tokenizer's. Such
    an id decodes to U+FFFD here, so NeMo keys it by a vocabulary string no real token has."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int) -> None:
        self._tok, self._size, self._known = tokenizer.backend, vocab_size, tokenizer.vocab_size
        self.backend_tokenizer = self

    def __len__(self) -> int:
        return self._size

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if all(i < self._known for i in ids):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return "\ufffd"

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) if token_id < self._known else f"\ufffd{token_id}"


def build_model(config: V41Config, tokenizer: TextTokenizer, seed: int) -> nn.Module:
    """NeMo's V4.1 model for `config`'s text fields (torch backends, a one-layer vision tower), initialised
    from `seed` in fp32 on the CPU; its Engram token map checked against ours."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import BackendConfig, DeepseekV41ForCausalLM

    fields = {k: v for k, v in config.to_dict()["text_config"].items() if k != "model_type"}
    vision = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notes on the release's field names
        nemo_config = DeepseekV41Config(text_config={**fields, "dtype": "float32"}, vision_config=vision,
                                        dtype="float32")
        backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                                dispatcher="torch", rope="torch", gate_precision="float32")
        model = DeepseekV41ForCausalLM(nemo_config, backend=backend,
                                       tokenizer=ModelVocabulary(tokenizer, config.vocab_size))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    if model.model.engram_hash is not None:
        ours = vocabulary_map(tokenizer.backend, config.vocab_size)[0].tolist()
        if list(model.model.engram_hash._token_map_values) != ours:
            raise RuntimeError("NeMo's Engram token map differs from the engine's for this tokenizer")
    return model


# -- training ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainSettings:
    steps: int
    lr: float = 1e-3
    log_every: int = 10


def learning_rate(settings: TrainSettings, step: int) -> float:
    """Step `step`'s (1-based) rate: linear warmup, then a cosine from the peak to FINAL_LR_SHARE of it."""
    warmup = max(1, round(settings.steps * WARMUP_SHARE))
    if step <= warmup:
        return settings.lr * step / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def train(model: nn.Module, data: Iterable[torch.Tensor], settings: TrainSettings,
          device: torch.device) -> list[dict]:
    """`settings.steps` AdamW steps on the batches of `data` (token windows [B, L], next-token loss);
    returns the curve: the mean loss over each `log_every` steps, also printed."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in trained if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for _, p in trained if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))
    model.train()
    curve, losses, start = [], [], time.perf_counter()
    for step, batch in zip(range(1, settings.steps + 1), data):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step)
        batch = batch.to(device)
        with _autocast(device):
            loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % settings.log_every == 0 or step == settings.steps:
            point = {"step": step, "loss": round(torch.stack(losses).mean().item(), 5),
                     "lr": learning_rate(settings, step), "seconds": round(time.perf_counter() - start, 2)}
            curve.append(point)
            losses.clear()
            print(json.dumps(point), flush=True)
    model.eval()
    return curve


@torch.no_grad()
def mean_loss(model: nn.Module, windows: torch.Tensor, device: torch.device, batch: int) -> float:
    """The mean next-token loss over `windows` [N, L], `batch` at a time (the model left in eval mode)."""
    model.eval()
    total = 0.0
    for start in range(0, len(windows), batch):
        chunk = windows[start:start + batch].to(device)
        with _autocast(device):
            total += model(chunk, labels=chunk).loss.float().item() * len(chunk)
    return total / len(windows)


# -- export -----------------------------------------------------------------------------------------------------

def exported_tensors(model: nn.Module, config: V41Config, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's plain tensors: the backbone as NeMo's adapter exports it, in fp32 on the CPU, and
    draft layers of the writer's seeded random init."""
    exported = model.state_dict_adapter.to_hf(model.state_dict())
    expected = expected_tensors_v41(config)
    missing = sorted(set(expected) - set(exported))
    if missing:
        raise RuntimeError(f"NeMo's export lacks {len(missing)} backbone tensors, e.g. {missing[0]}")
    tensors = {name: exported[name].detach().float().cpu().contiguous() for name in expected}
    draft = RandomTensors(config, seed, torch.float32, "cpu", include_mtp=True)
    tensors.update({name: draft[name] for name in draft if is_draft_tensor(name)})
    return tensors


def write_checkpoint(folder: Path, config: V41Config, tokenizer: TextTokenizer,
                     tensors: dict[str, torch.Tensor], quantized: bool) -> str:
    """`tensors` (plain) as a checkpoint in the new folder `folder`, in the release's formats when
    `quantized`; returns its content hash. Written under a hidden sibling name, renamed when complete."""
    if quantized:
        config, tensors = quantize(config, tensors)
    tmp = folder.parent / f".{folder.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    tmp.mkdir(parents=True)
    try:
        digest = write_weights(tmp, tensors)
        tokenizer.save(tmp)
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
        os.rename(tmp, folder)  # also succeeds onto an empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    store_hash(weight_files(folder), digest)
    return digest


# -- speculation ------------------------------------------------------------------------------------------------

def prompts_from(docs: list[list[int]], count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` documents that have more than that."""
    return [doc[:length] for doc in docs if len(doc) > length][:count]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, and the engine steps it took."""
    ids = [llm.add_request(prompt, params) for prompt in prompts]
    outputs, steps = {}, 0
    while llm.has_unfinished():
        outputs.update((out.request_id, out.token_ids) for out in llm.step())
        steps += 1
    return [outputs[i] for i in ids], steps


def speculation(folder: Path, prompts: list[list[int]], device: str, max_tokens: int, draft_tokens: int) -> dict:
    """Greedy requests without speculation, then with the checkpoint's DSpark draft: whether the token ids
    are identical, the engine steps of each, the scheduler's counters, the share of drafts kept and the
    mean accepted length (drafts kept per verify step). `distinct_token_share`, the mean share of distinct
    ids in a request's output, flags a target that repeats itself (an undertrained one greedily emits one
    token over and over, which any drafter predicts)."""
    llm = LLM(folder, device=device, max_num_seqs=len(prompts),
              max_model_len=max(map(len, prompts)) + max_tokens + draft_tokens + 1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain, plain_steps = _generate(llm, prompts, params)
    spec = llm.with_engine(replace(llm.engine_config, speculation="dspark", draft_tokens=draft_tokens))
    drafted, spec_steps = _generate(spec, prompts, params)
    counters = {key: getattr(spec.scheduler, attr) for key, attr in COUNTERS.items()}
    return {"prompts": len(prompts), "prompt_tokens": len(prompts[0]), "max_tokens": max_tokens,
            "draft_tokens": draft_tokens, "identical": plain == drafted,
            "distinct_token_share": round(sum(len(set(ids)) / len(ids) for ids in plain) / len(plain), 6),
            "steps": {"off": plain_steps, "dspark": spec_steps}, "counters": counters,
            "verify_lengths": {str(k): v for k, v in sorted(spec.scheduler.verify_lengths.items())},
            "acceptance": round(counters["drafts_kept"] / max(counters["drafted"], 1), 6),
            "mean_accepted": round(counters["drafts_kept"] / max(counters["verify_chunks"], 1), 6)}


def speed(folder: Path, prompts: list[list[int]], device: str, dtype: str, batches: list[int],
          temperatures: list[float], max_tokens: int, draft_tokens: int,
          policies: tuple[str, ...] = ("fixed", "throughput")) -> Iterator[dict]:
    """Decode tokens per second per batch size and temperature: speculation off, then DSpark under each
    `verify_policy`, then off again (how far two plain engines drift apart); each row beside off's, with
    its counters and whether its outputs' bits are off's, yielded as soon as it is measured."""
    llm = LLM(folder, device=device, dtype=dtype, max_num_seqs=max(batches),
              max_model_len=max(map(len, prompts)) + max_tokens + draft_tokens + 1)
    for batch in batches:
        for temperature in temperatures:
            requests = [SimpleNamespace(prompt=prompt, params=SamplingParams(
                temperature=temperature, seed=1000 + i if temperature else None, max_tokens=max_tokens,
                ignore_eos=True)) for i, prompt in enumerate(prompts[:batch])]
            plain, steps, seconds, counts = timed(llm, requests, None)
            tokens = sum(len(sig[0]) for sig in plain)
            base = {"batch": batch, "temperature": temperature, "prompt_tokens": len(requests[0].prompt),
                    "new_tokens": max_tokens}
            yield {**base, "speculation": "off", "steps": steps, "seconds": round(seconds, 3),
                   "tokens_per_s": round(tokens / seconds, 1), **clock_figures(counts)}
            off_seconds = seconds
            for policy in policies:
                got, steps, seconds, counts = timed(llm, requests, None, speculation="dspark",
                                                    draft_tokens=draft_tokens, verify_policy=policy)
                yield {**base, "speculation": f"dspark-{draft_tokens}", "verify_policy": policy, "steps": steps,
                       "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                       "speedup": round(off_seconds / seconds, 3),
                       "acceptance": round(counts["kept"] / max(counts["drafted"], 1), 4),
                       "mean_accepted": round(counts["kept"] / max(counts["verify_chunks"], 1), 4),
                       "tokens_per_step": round(tokens / steps, 4), **counts, "bitwise_equal": got == plain}
            again, steps, seconds, counts = timed(llm, requests, None)  # off's engine-to-engine drift, for scale
            yield {**base, "speculation": "off", "again": True, "steps": steps, "seconds": round(seconds, 3),
                   "tokens_per_s": round(tokens / seconds, 1), "speedup": round(off_seconds / seconds, 3),
                   **clock_figures(counts), "bitwise_equal": again == plain}


# -- the run ----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrors(prog="train_target.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v41-small", choices=PRESETS)
    parser.add_argument("--steps", type=_positive(int), default=350, help="optimizer steps")
    parser.add_argument("--batch", type=_positive(int), default=64, help="sequences per step")
    parser.add_argument("--seq-len", type=_positive(int), default=512, help="tokens per sequence")
    parser.add_argument("--lr", type=_positive(float), default=1e-3, help="peak AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initial weights, batch order, draft layers' init")
    parser.add_argument("--held-out-share", type=_positive(float), default=0.05,
                        help="share of the files held out (by path hash) for evaluation")
    parser.add_argument("--max-files", type=_positive(int), default=None,
                        help="read only the first N files in sorted order (dry runs)")
    parser.add_argument("--eval-windows", type=_positive(int), default=64, help="held-out windows for the loss")
    parser.add_argument("--log-every", type=_positive(int), default=10)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--quantized", action="store_true",
                        help="store the checkpoint in the release's formats (FP8 dense weights, MXFP4 experts)")
    parser.add_argument("--distill-steps", type=int, default=0,
                        help="then distill the DSpark draft layers this many steps and measure speculation")
    distill_defaults = DistillSettings()
    parser.add_argument("--distill-prompts", type=_positive(int), default=distill_defaults.prompts,
                        help="prompts the target continues for distillation (half greedily, half sampled)")
    parser.add_argument("--distill-batch", type=_positive(int), default=distill_defaults.batch,
                        help="draft blocks per distillation step")
    parser.add_argument("--spec-prompts", type=_positive(int), default=16, help="held-out prompts for speculation")
    parser.add_argument("--prompt-tokens", type=_positive(int), default=64)
    parser.add_argument("--max-tokens", type=_positive(int), default=96, help="greedy tokens per speculation request")
    parser.add_argument("--draft-tokens", type=_positive(int), default=5, help="DSpark drafts per step")
    parser.add_argument("--speed-batches", type=_positive(int), nargs="*", default=[1, 16],
                        help="with --distill-steps: batch sizes of the speed runs (none: no speed runs)")
    parser.add_argument("--speed-temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--speed-tokens", type=_positive(int), default=128, help="new tokens per speed request")
    parser.add_argument("--speed-policies", nargs="+", default=["fixed", "throughput"], choices=["fixed", "throughput"],
                        help="DSpark's verify policies timed in the speed runs")
    parser.add_argument("--dtype", default="bfloat16", help="the speed runs' dtype")
    parser.add_argument("--trained", default=None,
                        help="skip training: distill and measure a copy of the target an earlier run wrote to this "
                             "--checkpoint folder (then --distill-steps 0 measures its drafter as it is)")
    parser.add_argument("--checkpoint", required=True, help="new (or empty) folder for the trained checkpoint")
    parser.add_argument("--out", required=True, help="the record's JSON file")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out: folder {Path(args.out).parent} does not exist")
    checkpoint = Path(args.checkpoint)
    if checkpoint.exists() and not (checkpoint.is_dir() and not any(checkpoint.iterdir())):
        parser.error(f"--checkpoint: {checkpoint} already exists and is not an empty folder")
    if not 0 < args.held_out_share < 1:
        parser.error(f"--held-out-share must be between 0 and 1, got {args.held_out_share}")
    if args.distill_steps < 0:
        parser.error(f"--distill-steps must be >= 0, got {args.distill_steps}")
    if any(t < 0 for t in args.speed_temperatures):
        parser.error(f"--speed-temperatures must be >= 0, got {args.speed_temperatures}")
    block = v41_preset_config(args.preset).dspark_block_size
    if args.draft_tokens > block:
        parser.error(f"--draft-tokens {args.draft_tokens}: {args.preset}'s DSpark drafts at most {block} a step")
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as err:  # e.g. cuda asked for on a CPU-only build
        parser.error(f"--device {args.device!r} is not usable here ({str(err).splitlines()[0]})")
    return args


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def train_and_write(args: argparse.Namespace, config: V41Config, tokenizer: TextTokenizer, corpus: Corpus,
                    device: torch.device, folder: Path) -> dict:
    """Train the preset's model and write it to `folder`; the training's record."""
    evaluation = corpus.held_out[::max(1, len(corpus.held_out) // args.eval_windows)][:args.eval_windows]
    model = build_model(config, tokenizer, args.seed).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = mean_loss(model, evaluation, device, args.batch)
        train_start = time.perf_counter()
        curve = train(model, batches(corpus.train, args.batch, args.seed),
                      TrainSettings(args.steps, args.lr, args.log_every), device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_seconds = time.perf_counter() - train_start
        after = mean_loss(model, evaluation, device, args.batch)
    nondeterministic = sorted({str(w.message).splitlines()[0] for w in caught if "deterministic" in str(w.message)})
    digest = write_checkpoint(folder, config, tokenizer, exported_tensors(model, config, args.seed), args.quantized)
    print(f"{folder}: content hash {digest}; held-out loss {before:.3f} -> {after:.3f}", flush=True)
    return {
        "torch": torch.__version__, "python": platform.python_version(), "deepinfer": __version__,
        "threads": torch.get_num_threads(), "preset": args.preset, "seed": args.seed, "steps": args.steps,
        "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "precision": "bf16 autocast" if
        device.type == "cuda" else "fp32", "deterministic_algorithms": True, "nondeterministic_ops": nondeterministic,
        "corpus": {"root": "sysconfig stdlib", "files": len(corpus.train_files) + len(corpus.held_out_files),
                   "train_files": len(corpus.train_files), "held_out_files": len(corpus.held_out_files),
                   "skipped_not_utf8": len(corpus.skipped), "sha256": corpus.sha256,
                   "train_tokens": corpus.train_tokens, "held_out_tokens": corpus.held_out_tokens,
                   "held_out_share": args.held_out_share, "eval_windows": len(evaluation)},
        "train_loss": curve, "held_out_loss": {"before": round(before, 5), "after": round(after, 5)},
        "train_seconds": round(train_seconds, 2),
        "train_tokens_per_s": round(args.steps * args.batch * args.seq_len / train_seconds, 1),
        "checkpoint": {"quantized": args.quantized, "content_hash": digest, "tokenizer": tokenizer.content_hash},
    }


def reuse_trained(trained: Path, folder: Path, args: argparse.Namespace) -> dict:
    """Copy the target an earlier run trained (its checkpoint folder, with the training's record) to
    `folder`, checked against that record; the record, noting where it came from."""
    try:
        record = json.loads((trained / TRAIN_RECORD).read_text())
    except (OSError, ValueError) as err:
        raise TrainError(f"--trained {trained}: no training record {TRAIN_RECORD} ({err})") from None
    for name in ("preset", "seed"):
        if record.get(name) != getattr(args, name):
            raise TrainError(f"--trained {trained}: trained with {name} {record.get(name)!r}, not {getattr(args, name)!r}")
    shutil.copytree(trained, folder, dirs_exist_ok=True)
    digest = content_hash(folder)
    known = {record.get("checkpoint", {}).get("content_hash"): "as trained"}
    if (folder / DISTILL_RECORD).is_file():  # a run that distilled it after training
        known[json.loads((folder / DISTILL_RECORD).read_text()).get("content_hash", {}).get("after")] = "distilled earlier"
    if digest not in known:
        raise TrainError(f"--trained {trained}: content hash {digest} is neither the trained one nor a distillation's")
    record["trained"] = {"by": record.pop("command", None), "on": record.pop("device", None), "folder": trained.name,
                         "drafter": known[digest], "content_hash": digest}
    return record


def run(args: argparse.Namespace) -> dict:
    """Train, export, optionally distill and measure speculation; the record, also written to `--out` after
    each phase (a run stopped by a time limit keeps what it measured)."""
    start = time.perf_counter()
    device = torch.device(args.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = v41_preset_config(args.preset)
    tokenizer = preset_tokenizer("v41", config.vocab_size)
    corpus = load_corpus(tokenizer, corpus_files(max_files=args.max_files), args.seq_len, args.held_out_share)
    if len(corpus.train) < args.batch or not len(corpus.held_out):
        raise TrainError(f"{len(corpus.train)} training and {len(corpus.held_out)} held-out windows of "
                         f"{args.seq_len} tokens: too few for batches of {args.batch}; read more files")
    prompts = prompts_from(corpus.held_out_docs, max([args.spec_prompts, *args.speed_batches]), args.prompt_tokens)
    wanted = max(args.speed_batches, default=1)
    if (args.distill_steps or args.trained) and len(prompts) < wanted:
        raise TrainError(f"{len(prompts)} held-out files have more than {args.prompt_tokens} tokens; "
                         f"speculation needs {wanted} prompts")
    folder = Path(args.checkpoint)
    command = " ".join(a if a != args.out else Path(args.out).name for a in args.argv)
    this_run = {"command": f"python benchmarks/train_target.py {command}",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if args.trained:
        record = {**this_run, **reuse_trained(Path(args.trained), folder, args)}
    else:
        record = {**this_run, **train_and_write(args, config, tokenizer, corpus, device, folder)}
        (folder / TRAIN_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    save = partial(write_record, Path(args.out), record, start)
    save()
    if args.distill_steps:
        distill_start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            text = Path(scratch) / "distill-corpus.txt"
            text.write_text(distill_corpus(corpus), encoding="utf-8")
            distilled = distill(folder, DistillSettings(steps=args.distill_steps, seed=args.seed, device=args.device,
                                                        prompts=args.distill_prompts, batch=args.distill_batch,
                                                        corpus=str(text)))
        record["distill"] = {"steps": args.distill_steps, "prompts": args.distill_prompts, "batch": args.distill_batch,
                             "corpus_sha256": distilled["data"]["corpus_sha256"],
                             "seconds": round(time.perf_counter() - distill_start, 2),
                             "loss": [distilled["loss"][0], distilled["loss"][-1]],
                             "acceptance": distilled["acceptance"],
                             "content_hash": distilled["content_hash"]["after"]}
        print(json.dumps({"distill": record["distill"]}), flush=True)
        save()
    if args.distill_steps or args.trained:
        record["speculation"] = speculation(folder, prompts[:args.spec_prompts], args.device, args.max_tokens,
                                            args.draft_tokens)
        print(json.dumps(record["speculation"]), flush=True)
        save()
        if args.speed_batches:
            record["speed"] = []
            for row in speed(folder, prompts, args.device, args.dtype, args.speed_batches, args.speed_temperatures,
                             args.speed_tokens, args.draft_tokens, args.speed_policies):
                record["speed"].append(row)
                print(json.dumps(row), flush=True)
                save()  # a run stopped by its time limit keeps the rows measured
    save()
    return record


def write_record(out: Path, record: dict, start: float) -> None:
    """The record as it stands, with the seconds since the run began."""
    record["wall_seconds"] = round(time.perf_counter() - start, 2)
    out.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        record = run(args)
    except TrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    if "speculation" in record and not record["speculation"]["identical"]:
        print("error: the token ids differ with speculation on and off", file=sys.stderr)
        return 1
    if not all(row.get("bitwise_equal", True) for row in record.get("speed", [])):
        print("error: a speed run's outputs differ from speculation off's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
