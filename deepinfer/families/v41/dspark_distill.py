"""Self-distillation of a V4.1 checkpoint's DSpark draft layers (`deepinfer dspark distill --model DIR`).

`checkpoint create` gives the draft layers random weights, which draft nothing the target would say.
This trains them on the target's own generations and writes them back into the checkpoint:

1. generations: the target (`LLM`, batch-invariant numerics) continues deterministic prompts (windows of
   the bundled corpus at seeded offsets), greedily for even prompts and sampled at temperature 1 for
   odd ones; the prompts from the corpus's last fifth are held out for the measurement;
2. features: one forward over each whole sequence hands out the streams entering the target layers
   `dspark_target_layer_ids` (`DeepseekV41.forward(..., streams_at=...)`), the draft's context at every
   position, and the target's final hidden states, whose logits are the distributions it drew from;
3. training (`train`): the target stays frozen (the embedding and head the draft shares included);
   every `mtp.*` tensor is trained with AdamW through `DSpark.forward` in plain PyTorch ops
   (`kernels.bind("fast")`: the engine's batch-invariant CUDA kernels have no backward). A block is
   anchored at a generated position n: input [t_n, noise ...] at n .., context the features of the
   sliding window before n, labels t_{n+1} .. t_{n+B}. Slot j's loss is the KL divergence from the
   target's distribution at position n + j to the draft's Markov-corrected one given the true previous
   token t_{n+j} (teacher forcing: what the draft sees when the slots before it held), weighted by
   exp(-j / SLOT_DECAY) since a slot only counts when all before it hold. The whole distribution
   teaches more per block than the one token drawn from it (the cross-entropy against that token has
   the same expectation on sampled sequences, with more noise). The selection
   biases of the routers get no gradient (top-k is not differentiable) and keep their values;
4. measurement (`acceptance`): on the held-out generations, with the drafter before and after, each
   block's greedy drafts through the engine's inference path (`DSpark.blocks` then `DSpark.drafts`, as
   the engine's draft runner calls them) against the target's tokens: per slot the share of blocks
   whose drafts held up to and including it, and their sum, the mean accepted length;
5. writing back: the trained tensors in the checkpoint's stored formats (re-encoded as the writer
   encodes them), replacing the old ones file by file (`replace_tensors`: nothing else changes, an
   interruption leaves a loadable checkpoint), then the run's record `RECORD_NAME`.

The same command on the same checkpoint writes the same bits: every random choice is seeded, the CPU
work runs on a fixed number of threads and CUDA training under PyTorch's deterministic algorithms.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer import kernels
from deepinfer import LLM, SamplingParams, __version__
from deepinfer.checkpoint import DEFAULT_PRESET, create_checkpoint, load_draft_tensors
from deepinfer.checkpoint.files import deepinfer_home, read_headers, weight_files
from deepinfer.checkpoint.hashing import content_hash
from deepinfer.families.tensor_spec import FP4, FP8, SCALE
from deepinfer.families.v41.layout import expected_tensors_v41, quantize
from deepinfer.checkpoint.loader import weights_in_memory
from deepinfer.checkpoint.presets import preset_config
from deepinfer.checkpoint.writer import replace_tensors
from deepinfer.families.registry import load_config
from deepinfer.families.v41.config import V41Config
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.errors import DeepInferError
from deepinfer.families.v41.dspark import PRE_NORM, DSpark, target_features
from deepinfer.model.layers import Linear
from deepinfer.families.v41.model import DeepseekV41
from deepinfer.progress import Progress
from deepinfer.recipe.tokenizer import CORPUS_PATH
from deepinfer.sampling_params import derive_seed
from deepinfer.kernels import Ops
from deepinfer.kernels.cpu_isa import cpu_threads

RECORD_NAME = "dspark_distill.json"
RECORD_FORMAT = 1
PROMPT_TOKENS = 16
HELD_OUT_SHARE = 0.2  # the corpus's last fifth gives the held-out prompts
SLOT_DECAY = 4.0  # slot j's loss weight is exp(-j / SLOT_DECAY) (DeepSpec's default decay)
GRAD_CLIP = 1.0  # the gradient's norm is clipped to this before each step
WARMUP_SHARE = 0.05  # linear learning-rate warmup over this share of the steps, then a cosine to 0
CURVE_POINTS = 50  # the record's loss curve: the mean loss over each of this many stretches of steps
FEATURE_TOKENS = 4096  # tokens per forward when taking the features
SEED_NAMESPACE = "deepinfer-dspark-distill"
CODE_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]  # keys `distilled_checkpoint`


class DistillError(DeepInferError, ValueError):
    """Settings or a checkpoint that distillation cannot work with."""


@dataclass(frozen=True)
class DistillSettings:
    """What a distillation run does; the defaults distill `v41-tiny` in about a minute on one CPU core."""

    steps: int = 150  # optimizer steps
    seed: int = 0  # prompts, sampling and the blocks each step trains on
    lr: float = 3e-3  # peak AdamW learning rate
    batch: int = 64  # blocks per step
    prompts: int = 48  # training prompts (even ones continued greedily, odd ones sampled)
    held_out: int = 32  # held-out prompts for the acceptance measurement
    max_tokens: int = 96  # tokens the target generates per prompt
    device: str = "cpu"
    threads: int = 1  # CPU threads (the bits of CPU matmuls depend on it)
    corpus: str = ""  # a UTF-8 text file whose windows are the prompts ("": the bundled corpus)

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "prompts", "held_out", "max_tokens", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DistillError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DistillError(f"seed must be an integer >= 0, got {self.seed!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise DistillError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.corpus and not Path(self.corpus).is_file():
            raise DistillError(f"corpus {self.corpus}: no such file")

    def corpus_text(self) -> str:
        """The text the prompts come from: a target should be distilled on its own domain's text (a code
        model's continuations of the bundled English story teach a drafter little about its code)."""
        path = Path(self.corpus) if self.corpus else CORPUS_PATH
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise DistillError(f"corpus {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


@dataclass
class Generations:
    """The target's sequences, prompt then continuation: token ids [N, L], the draft's context features
    [N, L, 3 * hidden] and the target's final hidden states [N, L, hidden] at every position, on the
    device; `greedy` [N] says how each was continued."""

    tokens: torch.Tensor
    features: torch.Tensor
    final: torch.Tensor
    greedy: torch.Tensor

    def rows(self, index: slice) -> Generations:
        return Generations(self.tokens[index], self.features[index], self.final[index], self.greedy[index])


def distill(folder: str | Path, settings: DistillSettings = DistillSettings(), progress: bool = False) -> dict:
    """Distill the DSpark draft layers of the checkpoint in `folder` in place; returns the run's record
    (also written to `folder / RECORD_NAME`)."""
    folder = Path(folder)
    before = load_draft_tensors(folder)  # one-line errors for a missing folder, V4, no draft layers
    text = settings.corpus_text()
    config = load_config(folder)
    with cpu_threads(settings.threads):
        llm = LLM(folder, device=settings.device, max_num_seqs=settings.prompts + settings.held_out,
                  max_model_len=PROMPT_TOKENS + settings.max_tokens)
        data = generate(llm, settings, text)
        train_data, held_out = data.rows(slice(settings.prompts)), data.rows(slice(settings.prompts, None))
        measured = {"before": acceptance(_inference_draft(llm, before), held_out)}
        draft = _draft(config, before, _TargetParts(llm.model), settings.device)
        curve = train(draft, train_data, settings, progress)
        stored = _as_stored(folder, config, _checkpoint_tensors(draft))
        measured["after"] = acceptance(_inference_draft(llm, weights_in_memory(config, dict(stored), None)), held_out)
        hashes = {"before": content_hash(folder)}
    hashes["after"] = replace_tensors(folder, stored)
    record = {
        "format": RECORD_FORMAT, "deepinfer": __version__, "code": CODE_VERSION, "settings": asdict(settings),
        "data": {"train_sequences": settings.prompts, "held_out_sequences": settings.held_out,
                 "prompt_tokens": PROMPT_TOKENS, "generated_tokens": settings.max_tokens,
                 "corpus_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()},
        "loss": curve, "acceptance": measured, "content_hash": hashes,
    }
    _write_record(folder, record)
    return record


@contextmanager
def _deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On CUDA, PyTorch's deterministic kernels (backward passes accumulate with atomics otherwise), with
    the cuBLAS workspace they need; restored afterwards. The engine's own kernels are deterministic."""
    if device.type != "cuda":
        yield
        return
    before, workspace = torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG")


# -- data -----------------------------------------------------------------------------------------------------

def generate(llm: LLM, settings: DistillSettings, text: str) -> Generations:
    """The target's continuations of `settings.prompts` training prompts then `settings.held_out` held-out
    ones (windows of `text`'s first and last parts), with their features."""
    if llm.tokenizer is None:
        raise DistillError("distillation prompts come from text: the checkpoint needs its tokenizer.json")
    corpus = llm.tokenizer.encode(text)
    split = int(len(corpus) * (1 - HELD_OUT_SHARE))
    generator = torch.Generator().manual_seed(settings.seed)
    prompts = (_windows(corpus[:split], settings.prompts, generator)
               + _windows(corpus[split:], settings.held_out, generator))
    params = [SamplingParams(temperature=float(i % 2), max_tokens=settings.max_tokens, ignore_eos=True,
                             seed=derive_seed(settings.seed, i, SEED_NAMESPACE)) for i in range(len(prompts))]
    sequences = [prompt + output.token_ids for prompt, output in zip(prompts, llm.generate(prompts, params))]
    device = llm.device
    greedy = torch.tensor([i % 2 == 0 for i in range(len(prompts))], device=device)
    return Generations(torch.tensor(sequences, device=device), *_features(llm, sequences), greedy)


def _windows(tokens: list[int], count: int, generator: torch.Generator) -> list[list[int]]:
    """`count` windows of PROMPT_TOKENS tokens at seeded offsets in `tokens`."""
    if len(tokens) < PROMPT_TOKENS:
        raise DistillError(f"the tokenizer makes {len(tokens)} tokens of a part of the corpus, fewer than a "
                           f"prompt's {PROMPT_TOKENS}")
    starts = torch.randint(len(tokens) - PROMPT_TOKENS + 1, (count,), generator=generator).tolist()
    return [tokens[start:start + PROMPT_TOKENS] for start in starts]


def _features(llm: LLM, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's features [N, L, 3 * hidden] and the target's final hidden states [N, L, hidden] at
    every position of equally long sequences, from one forward over whole sequences (FEATURE_TOKENS
    tokens at a time), as ordinary fp32 tensors (autograd cannot save the inference-mode forward's)."""
    model: DeepseekV41 = llm.model
    length = len(sequences[0])
    per_forward = max(1, FEATURE_TOKENS // length)
    parts, finals = [], []
    for start in range(0, len(sequences), per_forward):
        group = sequences[start:start + per_forward]
        cache = CacheManager(model.pools, max_num_seqs=len(group), max_model_len=length,
                             max_step_tokens=length * len(group), num_blocks=None, block_size=16, dtype=llm.dtype,
                             device=llm.device)
        chunks = []
        for i, ids in enumerate(group):
            seq = Sequence(i, ids, SamplingParams(temperature=0), seed=0)
            cache.grow(seq.blocks, length)
            chunks.append(ScheduledChunk(seq, 0, length))
        host, _ = ModelRunner(model, cache, llm.device).build_batch(chunks)
        host.sample_index = None
        batch, _ = host.to(llm.device)
        streams: dict[int, torch.Tensor] = {}
        final = model(batch, cache.layer_views, streams_at=streams)
        features = target_features(streams, model.config.dspark_target_layer_ids, model.ops)
        parts.append(features[:length * len(group)].float().view(len(group), length, -1))
        finals.append(final[:length * len(group)].float().view(len(group), length, -1))
    return torch.cat(parts).clone(), torch.cat(finals).clone()


# -- training -------------------------------------------------------------------------------------------------

class _TargetParts(nn.Module):
    """The target's embedding and head, frozen, in fp32 and computing with the training's ops: what the
    trained draft shares (`DSpark.share` reads `embed` and `head`)."""

    def __init__(self, target: DeepseekV41) -> None:
        super().__init__()
        weight = target.head.weight
        self.embed = nn.Embedding.from_pretrained(target.embed.weight.float().clone(), freeze=True)
        self.head = Linear(weight.shape[1], weight.shape[0], _training_ops(weight.device), torch.float32, "meta")
        self.head.weight = nn.Parameter(weight.float().clone(), requires_grad=False)


def _training_ops(device: torch.device | str) -> Ops:
    return kernels.bind("fast", torch.device(device))


def _draft(config: V41Config, tensors: dict[str, torch.Tensor], target: nn.Module, device: str) -> DSpark:
    """A DSpark in fp32 with every parameter trainable, from copies of the checkpoint's decoded draft tensors.

    It runs without the window cache's FP8 quantize-dequantize: autograd would carry the gradient back
    through the FP8 cast in FP8 too, where the keys' gradients underflow to zero (the engine's drafts,
    and the measurement's, apply it)."""
    draft = DSpark(config, _training_ops(device), torch.float32, device="meta", cache_qdq=False)
    draft.load_tensors({name: tensor.to(torch.float32, copy=True) for name, tensor in tensors.items()}, device)
    draft.share(target)
    for parameter in draft.parameters():
        parameter.requires_grad_(True)
    return draft


def train(draft: DSpark, data: Generations, settings: DistillSettings, progress: bool = False) -> list[dict]:
    """Train `draft` on blocks anchored at the generated positions of `data` (see the module docstring);
    returns the loss curve: the mean token and confidence losses over each of CURVE_POINTS stretches."""
    anchors = _anchors(data, draft.config.dspark_block_size)
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    stretch = math.ceil(settings.steps / CURVE_POINTS)
    curve, sums = [], torch.zeros(2, dtype=torch.float64)
    device = data.tokens.device
    with _deterministic_kernels(device), Progress("distill", settings.steps, enabled=progress, unit="steps") as bar:
        for step in range(settings.steps):
            picked = anchors[torch.randint(len(anchors), (settings.batch,), generator=generator)]
            sums += torch.tensor(_step(draft, optimizer, data, picked.to(device), _learning_rate(settings, step)),
                                 dtype=torch.float64)
            if (step + 1) % stretch == 0 or step + 1 == settings.steps:
                count = step % stretch + 1
                curve.append({"step": step + 1, "loss": round(sums[0].item() / count, 6),
                              "confidence_loss": round(sums[1].item() / count, 6)})
                sums.zero_()
            bar.update(1)
    return curve


def _step(draft: DSpark, optimizer: torch.optim.Optimizer, data: Generations, picked: torch.Tensor,
          lr: float) -> tuple[float, float]:
    """One AdamW step (gradient norm clipped at GRAD_CLIP) on the blocks at `picked`; their token and
    confidence losses."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    token_loss, confidence_loss = _losses(draft, data, picked)
    optimizer.zero_grad(set_to_none=True)
    (token_loss + confidence_loss).backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), GRAD_CLIP)
    optimizer.step()
    return token_loss.item(), confidence_loss.item()


def _learning_rate(settings: DistillSettings, step: int) -> float:
    warmup = max(1, round(settings.steps * WARMUP_SHARE))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    return settings.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, settings.steps - warmup)))


def _anchors(data: Generations, size: int) -> torch.Tensor:
    """[A, 2] (sequence, position n) of every block whose input token and B labels the target generated."""
    count, length = data.tokens.shape
    positions = torch.arange(PROMPT_TOKENS, length - size)
    if not len(positions):
        raise DistillError(f"max_tokens must exceed the draft's block size {size}")
    return torch.cartesian_prod(torch.arange(count), positions)


def _losses(draft: DSpark, data: Generations, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token loss, confidence loss) of the blocks at `picked` [A, 2].

    The confidence head learns, by binary cross-entropy, whether each slot's greedy draft equals the
    target's token given the true previous tokens: the chance that the slot holds once the slots before
    it held, which is what the engine multiplies along a block (`draft_runner.confident_lengths`), and
    what the draft's inputs mean then (the Markov input is the true previous token exactly when the
    slots before held). Its inputs are detached, so it trains `confidence_head.proj` alone: a probe
    that cannot trade the drafts' quality for being easier to predict."""
    size, window = draft.config.dspark_block_size, draft.config.sliding_window
    seq, anchor = picked.unbind(1)
    positions = anchor.unsqueeze(1) - window + torch.arange(window, device=anchor.device)
    valid = positions >= 0
    features = data.features[seq.unsqueeze(1), positions.clamp(min=0)]
    out = draft(data.tokens[seq, anchor], anchor, features, valid)
    slots = anchor.unsqueeze(1) + torch.arange(size + 1, device=anchor.device)
    previous, labels = data.tokens[seq.unsqueeze(1), slots[:, :-1]], data.tokens[seq.unsqueeze(1), slots[:, 1:]]
    last = draft.mtp[-1]
    bias, embedding = last.markov_head(previous)
    logits = out.logits + bias
    with torch.no_grad():
        teacher = draft.head(data.final[seq.unsqueeze(1), slots[:, :-1]]).float().log_softmax(dim=-1)
    weights = torch.exp(-torch.arange(size, device=logits.device) / SLOT_DECAY)
    token_loss = F.kl_div(logits.log_softmax(dim=-1), teacher, log_target=True, reduction="none").sum(dim=-1)
    token_loss = (token_loss * weights).sum(dim=1).mean() / weights.sum()
    hidden = out.hidden if draft.confidence_input == PRE_NORM else out.normed
    confidence = last.confidence_head(hidden.detach(), embedding.detach())
    held = (logits.detach().argmax(dim=-1) == labels).float()
    return token_loss, F.binary_cross_entropy_with_logits(confidence, held)


# -- measurement ----------------------------------------------------------------------------------------------

def _inference_draft(llm: LLM, tensors: dict[str, torch.Tensor]) -> DSpark:
    """A DSpark as the engine runs it (its ops, dtype and device), with `tensors` (decoded), sharing the
    target's embedding and head."""
    draft = DSpark(llm.config, llm.model.ops, llm.dtype, device="meta")
    draft.load_tensors(dict(tensors), llm.device)
    draft.share(llm.model)
    return draft


def acceptance(draft: DSpark, data: Generations) -> dict:
    """Per kind of generation (greedy, sampled): `per_slot`, the share of blocks whose greedy drafts held
    up to and including each slot; `mean_accepted`, their sum; `head_per_slot`, the confidence head's own
    mean survival there (the chance it gave that the drafts through each slot all hold: beside
    `per_slot`, how well calibrated it is); `blocks`, how many were drafted. Every generated position
    that has all of its block's labels anchors a block."""
    size, window = draft.config.dspark_block_size, draft.config.sliding_window
    length = data.tokens.shape[1]
    anchors = torch.arange(PROMPT_TOKENS, length - size, device=data.tokens.device)
    positions = anchors.unsqueeze(1) - window + torch.arange(window, device=anchors.device)
    labels = anchors.unsqueeze(1) + 1 + torch.arange(size, device=anchors.device)
    held = {True: torch.zeros(size, dtype=torch.long), False: torch.zeros(size, dtype=torch.long)}
    believed = {True: torch.zeros(size, dtype=torch.float64), False: torch.zeros(size, dtype=torch.float64)}
    for tokens, features, greedy in zip(data.tokens, data.features, data.greedy.tolist()):
        main_x = draft.project(features)
        kv = draft.context_kv(main_x, torch.arange(length, device=anchors.device))
        out = draft.blocks(tokens[anchors], anchors, kv[:, positions.clamp(min=0)], positions >= 0)
        drafted = draft.drafts(out, tokens[anchors])
        held[greedy] += (drafted.tokens == tokens[labels]).long().cumprod(dim=1).sum(dim=0).cpu()
        believed[greedy] += drafted.confidence.double().cumprod(dim=1).sum(dim=0).cpu()
    counts = {greedy: int((data.greedy == greedy).sum()) * len(anchors) for greedy in (True, False)}
    return {kind: {"per_slot": [round(h / max(counts[greedy], 1), 6) for h in held[greedy].tolist()],
                   "mean_accepted": round(held[greedy].sum().item() / max(counts[greedy], 1), 6),
                   "head_per_slot": [round(b / max(counts[greedy], 1), 6) for b in believed[greedy].tolist()],
                   "blocks": counts[greedy]}
            for kind, greedy in (("greedy", True), ("sampled", False))}


# -- writing back ---------------------------------------------------------------------------------------------

def _checkpoint_tensors(draft: DSpark) -> dict[str, torch.Tensor]:
    """The draft's parameters under the checkpoint's names, in fp32: each layer's stacked routed experts
    (`w13` = [w1; w3] and `w2` per expert, as `Decoder.load_tensors` stacks them) split back."""
    out = {}
    for name, parameter in draft.named_parameters():
        prefix, attr = name.rsplit(".", 1)
        value = parameter.detach().float()
        if attr == "w13":
            for expert, (w1, w3) in enumerate(zip(*value.chunk(2, dim=1))):
                out[f"{prefix}.{expert}.w1.weight"], out[f"{prefix}.{expert}.w3.weight"] = w1, w3
        elif attr == "w2" and prefix.endswith("experts"):
            out.update({f"{prefix}.{expert}.w2.weight": w2 for expert, w2 in enumerate(value)})
        else:
            out[name] = value
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _as_stored(folder: Path, config: V41Config, plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`plain` draft tensors as the checkpoint stores its own: FP8 / MXFP4 with their scales where its
    config declares the release's quantization (`layout_v41.quantize`, as `checkpoint create` encodes
    them), every tensor in its stored dtype (a raw-byte scale or FP4 dtype reinterpreted, not converted)."""
    if config.quantization_config is not None:
        _, encoded = quantize(replace(config, quantization_config=None), plain)
        plain = {name: encoded[name] for name in encoded}
    kinds = expected_tensors_v41(config, include_mtp=True)
    headers = read_headers(weight_files(folder))
    stored = {}
    for name, tensor in plain.items():
        dtype = getattr(torch, headers[name][1])
        same_bytes = kinds[name].kind in (FP4, FP8, SCALE) and tensor.element_size() == dtype.itemsize
        stored[name] = tensor.view(dtype) if same_bytes else tensor.to(dtype)
    return stored


def _write_record(folder: Path, record: dict) -> None:
    partial = folder / f".{RECORD_NAME}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(partial, folder / RECORD_NAME)


# -- a distilled checkpoint for tests -------------------------------------------------------------------------

def distilled_checkpoint(preset: str = DEFAULT_PRESET, seed: int = 0, *, quantized: bool = True,
                         settings: DistillSettings = DistillSettings()) -> Path:
    """A `preset` checkpoint (weights of `seed`, stored as released when `quantized`) whose DSpark draft
    was distilled with `settings`, built once under `$DEEPINFER_HOME/distilled/` and reused after.

    The folder name carries a digest of the preset's config, the seed, the storage, the settings and
    this module's source, so a change to any of them builds a fresh one; it is built under a hidden
    name and renamed when its record is written, so a folder with its name is always complete."""
    key = json.dumps({"config": preset_config(preset).to_dict(), "seed": seed, "quantized": quantized,
                      "settings": asdict(settings), "code": CODE_VERSION}, sort_keys=True)
    target = deepinfer_home() / "distilled" / f"{preset}-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / RECORD_NAME).is_file():
        return target
    partial = target.parent / f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
    try:
        create_checkpoint(preset, partial, seed, quantized=quantized)
        distill(partial, settings)
        os.rename(partial, target)
    except OSError:
        if not (target / RECORD_NAME).is_file():  # not another builder's finished copy
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
