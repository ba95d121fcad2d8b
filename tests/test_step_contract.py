"""The engine step contract: `Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update()`.

- the runner never changes a sequence (only `Scheduler.update` does);
- a decode step reads the device once: the runner's output comes down in one copy and nothing in
  the model, the sampler or the output path synchronises on its own (counted with a shim on CPU,
  with `torch.cuda.set_sync_debug_mode` on CUDA);
- a request whose logits turn non-finite (NaN weights) finishes with an error while the others
  finish exactly as they would have.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from deepinfer import kernels
from deepinfer import LLM, SamplingParams
from deepinfer.engine.runner import ModelRunner, RunnerOutput
from deepinfer.engine.sampler import SamplingBatch
from deepinfer.transfer import Download

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)
PROMPTS = [list(range(2, 12)), list(range(40, 57)), list(range(100, 105))]


def decoding(llm: LLM) -> LLM:
    """`llm` with every prompt prefilled, so its next step is a pure decode step."""
    for prompt, params in zip(PROMPTS, [GREEDY, SAMPLED, GREEDY]):
        llm.add_request(prompt, params)
    while llm.scheduler.waiting or any(not seq.output_token_ids for seq in llm.scheduler.running):
        llm.step()
    return llm


def test_the_runner_never_changes_a_sequence():
    llm = decoding(LLM("preset:tiny", max_model_len=128, async_scheduling=False))
    scheduled = llm.scheduler.schedule()
    before = [copy.deepcopy(dataclasses.asdict(chunk.seq)) for chunk in scheduled.chunks]
    output = llm.runner.execute(scheduled)
    output.result(scheduled)
    assert [dataclasses.asdict(chunk.seq) for chunk in scheduled.chunks] == before
    llm.scheduler.update(scheduled, output.result(scheduled))
    assert all(len(chunk.seq.output_token_ids) == 2 for chunk in scheduled.chunks)


class SyncCounter:
    """Counts host reads of tensor data (the calls that synchronise with a device) made by the engine's
    device-side code. Host-side bookkeeping (building the step's metadata, the sampling settings) and
    the CPU experts' loop (on CUDA the Triton grouped kernel replaces it) are not counted; the one
    download of the runner's output counts once."""

    READS = ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero", "cpu", "numpy")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.paused, self.calls = 0, 0, []
        for name in self.READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name), name))
        for name in ("nonzero", "unique"):
            monkeypatch.setattr(torch, name, self._counted(getattr(torch, name), f"torch.{name}"))
        monkeypatch.setattr(ModelRunner, "build_batch", self.uncounted(ModelRunner.build_batch))
        monkeypatch.setattr(SamplingBatch, "host_tensors", staticmethod(self.uncounted(SamplingBatch.host_tensors)))
        monkeypatch.setattr(RunnerOutput, "result", self.uncounted(RunnerOutput.result))
        wait = Download.wait

        def counted_wait(download):
            self.count += 1
            self.calls.append("download")
            return self.uncounted(wait)(download)

        monkeypatch.setattr(Download, "wait", counted_wait)

    def _counted(self, fn, name):
        def wrapper(*args, **kwargs):
            if not self.paused:
                self.count += 1
                self.calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    def uncounted(self, fn):
        def wrapper(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1
        return wrapper


@pytest.mark.parametrize("numerics", ["batch_invariant", "fast"])
def test_a_decode_step_reads_the_device_once(monkeypatch, numerics):
    ops = kernels.bind(numerics, "cpu")
    llm = decoding(LLM("preset:tiny", max_model_len=128, numerics=numerics))
    counter = SyncCounter(monkeypatch)
    table = {name: getattr(ops, name) for name in kernels.OPS}
    table["moe_experts"] = counter.uncounted(ops.moe_experts)
    for module in llm.model.modules():
        if "ops" in vars(module):
            vars(module)["ops"] = kernels.Ops(numerics, "cpu", table)
    llm.runner.ops = kernels.Ops(numerics, "cpu", table)
    llm.step()
    assert counter.count == 1, counter.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_cuda_decode_step_synchronises_once(monkeypatch, async_scheduling):
    from cuda_syncs import synchronisations

    llm = decoding(LLM("preset:tiny", device="cuda", dtype="bfloat16", max_model_len=128,
                       async_scheduling=async_scheduling))
    waits, wait = [], Download.wait
    monkeypatch.setattr(Download, "wait", lambda download: waits.append(download) or wait(download))
    assert synchronisations(llm.step) == []  # nothing synchronises on its own ...
    assert len(waits) == 1  # ... and the host waits once, for the copy of one step's results (an event)


def test_non_finite_logits_end_only_the_request_they_reach():
    clean = LLM("preset:tiny", max_model_len=128)
    poisoned = LLM("preset:tiny", max_model_len=128)
    poisoned.model.model.embed_tokens.weight[45] = float("nan")  # only the second prompt holds token 45
    want = clean.generate(PROMPTS, [GREEDY, SAMPLED, GREEDY])
    got = poisoned.generate(PROMPTS, [GREEDY, SAMPLED, GREEDY])
    assert (got[0], got[2]) == (want[0], want[2])
    assert got[1].finish_reason == "error" and got[1].token_ids == []
    assert got[1].error == "non-finite logits at position 16"
    poisoned.reset_prefix_cache()
    clean.reset_prefix_cache()
    assert poisoned.scheduler.cache.num_free() == clean.scheduler.cache.num_free()  # its blocks were freed
