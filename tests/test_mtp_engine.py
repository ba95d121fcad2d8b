"""V4's MTP block inside the engine (`speculation="mtp"`): the drafts a step makes on the device are
the block's own (its KV rows written by the engine's steps at every position, with the right next
tokens across chunked prefill and rollbacks, read back through the window pool), and checkpoints without the block are refused in one line. That
outputs stay the same bits as without speculation is the V4 invariance matrix's (tests/test_invariance.py:
1, 3 and 5 drafts and a confidence threshold, in fp32 and bf16)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deepinfer import kernels
from checkpoint_edits import copy_with
from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import load_mtp_tensors, preset_config
from deepinfer.checkpoint.random_init import stored_random_tensors
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.drafter import DeviceDrafter
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.errors import DeepInferError
from test_step_contract import SyncCounter, decoding

MAX_TOKENS = 8


def _mtp(llm: LLM, **settings) -> LLM:
    return llm.with_engine(replace(llm.engine_config, speculation="mtp", **settings))


class Recording(DeviceDrafter):
    """Keeps every set of drafts the runner hands over, with the tokens they follow."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[int]]] = []

    def observe(self, seq: Sequence, length: int, drafts: list[int], survivals: list[float]) -> None:
        self.seen.append((seq.token_ids[:length], drafts))
        super().observe(seq, length, drafts, survivals)


def _target_streams(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The target's final streams [len(tokens), n, hidden] from one forward over `tokens`."""
    model, length = llm.model, len(tokens)
    cache = CacheManager(model.pools, max_num_seqs=1, max_model_len=length, max_step_tokens=length,
                         num_blocks=None, block_size=16, dtype=torch.float32, device="cpu")
    seq = Sequence(0, tokens, SamplingParams(temperature=0), seed=0)
    cache.grow(seq.blocks, length)
    batch, _ = ModelRunner(model, cache, "cpu").build_batch([ScheduledChunk(seq, 0, length)])
    batch.sample_index = None
    streams: dict[int, torch.Tensor] = {}
    model(batch, cache.layer_views, streams_at=streams)
    return streams[model.config.num_hidden_layers][:length]


def _offline_drafts(llm: LLM, target: torch.Tensor, tokens: list[int], count: int) -> list[int]:
    """The block's greedy drafts after `tokens`, each from the block run afresh over the whole sequence
    (no paged cache): positions 0 .. n - 1 read the target's streams (`target`, of these tokens or more:
    a position's streams depend on the tokens up to it), the drafted positions the block's own output
    streams one position back; draft j is the last position's greedy token."""
    mtp, n = llm.host.draft_model("mtp", True), len(tokens) - 1
    streams, ids = target[:n], list(tokens[1:])
    width = llm.config.sliding_window - 1
    context, invalid = torch.zeros(1, width, llm.config.head_dim), torch.zeros(1, width, dtype=torch.bool)
    drafts = []
    for _ in range(count):
        length = len(ids)
        out, _ = mtp(torch.tensor([ids]), torch.arange(length).unsqueeze(0), streams.unsqueeze(0), context, invalid)
        logits, _ = mtp.outputs(out[0, -1:])
        drafts.append(int(torch.argmax(logits[0])))
        ids.append(drafts[-1])
        streams = torch.cat([streams, out[0, -1:]])
    return drafts


def test_the_engine_drafts_what_the_mtp_block_drafts() -> None:
    """Greedy requests of short and long prompts (anchors inside and past the first window; the long
    one prefilled in chunks, whose last rows take their next token from the host), drafted in one batch
    with every verify step rolled back somewhere: every set of drafts equals the block run afresh."""
    llm = LLM("preset:tiny")
    spec = _mtp(llm, draft_tokens=3, max_num_batched_tokens=16)
    spec.scheduler.drafter = recording = Recording()
    window = llm.config.sliding_window
    prompts = [list(range(5, 12)), [(7 * i) % 900 + 3 for i in range(window + 9)], list(range(40, 43))]
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    anchors = sorted(len(tokens) - 1 for tokens, _ in recording.seen)
    assert anchors[0] < window < anchors[-1] and len(recording.seen) >= 3 * 3
    assert spec.scheduler.num_rollbacks > 0
    for prompt in prompts:
        seen = [(tokens, drafts) for tokens, drafts in recording.seen if tokens[:len(prompt)] == prompt]
        target = _target_streams(llm, max((tokens for tokens, _ in seen), key=len)[:-1])
        for tokens, drafts in seen:
            assert drafts == _offline_drafts(llm, target, tokens, 3), len(tokens)


def test_a_verify_step_with_mtp_drafts_reads_the_device_once(monkeypatch) -> None:
    """Writing the block's rows and drafting after sampling add no host read: the drafts come down with
    the step's one download."""
    ops = kernels.bind("batch_invariant", "cpu")
    llm = decoding(LLM("preset:tiny", max_model_len=128, speculation="mtp", draft_tokens=3))
    counter = SyncCounter(monkeypatch)
    table = {name: getattr(ops, name) for name in kernels.OPS}
    table["moe_experts"] = counter.uncounted(ops.moe_experts)
    for module in [*llm.model.modules(), *llm.host.draft_model("mtp", True).modules()]:
        if "ops" in vars(module):
            vars(module)["ops"] = kernels.Ops("batch_invariant", "cpu", table)
    llm.runner.ops = kernels.Ops("batch_invariant", "cpu", table)
    scheduled = llm.scheduler.schedule()
    llm.scheduler.undo(scheduled)
    assert all(chunk.num_draft == 3 for chunk in scheduled.chunks)
    llm.step()
    assert counter.count == 1, counter.calls


def test_a_folder_gives_its_mtp_tensors_and_one_without_is_refused(tiny_checkpoint, tmp_path) -> None:
    tensors = load_mtp_tensors(tiny_checkpoint)
    stored = stored_random_tensors(preset_config("tiny"), 0, torch.float32)
    assert tensors.keys() == {name for name in stored if name.startswith("mtp.")}
    assert all(torch.equal(tensors[name], stored[name]) for name in tensors)
    stripped = tmp_path / "stripped"
    copy_with(tiny_checkpoint, stripped, lambda t: [t.pop(n) for n in [n for n in t if n.startswith("mtp.")]])
    with pytest.raises(DeepInferError) as err:
        LLM(stripped, speculation="mtp")
    assert str(err.value) == f"{stripped}: the checkpoint has no MTP block (mtp.* tensors)"


@pytest.mark.parametrize("model,message", [
    ("preset:v41-tiny", "speculation=mtp runs a V4 checkpoint's MTP block; preset:v41-tiny:seed=0 is V4.1 "
                        "(its draft layers run with speculation=dspark)"),
])
def test_mtp_on_a_v41_model_is_refused_in_one_line(model: str, message: str) -> None:
    with pytest.raises(DeepInferError) as err:
        LLM(model, speculation="mtp")
    assert str(err.value) == message
