"""`deepinfer audit capture`: re-run a few suite requests and record an activation digest per op output.

How ops are seen: for the capture only, every model object that holds the numerics table (`self.ops`:
the modules, and the rotary tables) is handed its own copy of that table whose every primitive records
its output under the holder's module name (`model.layers.3.attn_norm`) and the primitive's name
(`rms_norm`); each block (`model.layers.N`, V4.1's `layers.N`) also records its output streams,
through a PyTorch forward hook, as op `output`. Everything is put back when the capture ends, so a
normal run has no check, wrapper or hook anywhere. Requests run one at a time, eagerly (no CUDA
graphs, no async scheduling, no speculation or prefix cache), so a request's steps do not depend on
the others. Ops built inside a composite op (the routed experts' matmuls) record only the
composite's output.

The file (see `write_capture`) is a safetensors file: a JSON header in its metadata and, per op
output of at most `value_cap` elements (`VALUE_CAP` by default), the raw values, so `audit bisect` can compute the max abs
and ulp differences of two captures made on different machines. An output with a row per token of
the step keeps the real tokens' rows only: a step pads its tokens to a bucket (`model.batch.bucket`),
and what the padding rows hold is junk that differs between devices (measured: 0.2 apart between a
CPU and an H100 in V4.1's attention, while every real row agreed to 1e-6).
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from deepinfer import LLM
from deepinfer.audit.bisect import BLOCK_OUTPUT, FORMAT, VERSION, digest
from deepinfer.errors import DeepInferError
from deepinfer.harness.suite_base import Suite, SuiteRequest
from deepinfer.kernels import Ops

VALUE_CAP = 64 * 1024  # by default, outputs of at most this many elements keep their raw values
AROUND_RADIUS = 2  # --around P captures the steps producing output tokens P-2 .. P+2
_BLOCK = re.compile(r"(^|\.)layers\.\d+$")

# (holder's name, its table) -> the table it runs during the capture: tests plant a difference here
Tables = Callable[[str, Ops], Ops]


@dataclass(frozen=True)
class Window:
    """Which steps of a request are kept, by the index of the output token a step produces (the
    prompt's last prefill step produces token 0; earlier prefill chunks count as before it)."""

    first: int | None  # None: from the first prefill step
    last: int

    @classmethod
    def steps(cls, decode_steps: int) -> Window:
        """The prefill and the first `decode_steps` decode steps."""
        return cls(None, decode_steps)

    @classmethod
    def around(cls, position: int) -> Window:
        return cls(max(0, position - AROUND_RADIUS), position + AROUND_RADIUS)

    def keeps(self, token: int) -> bool:
        return (self.first is None or token >= self.first) and token <= self.last


def _stats(tensor: torch.Tensor) -> dict:
    values = tensor.detach().double()
    finite = torch.isfinite(values)
    kept = values[finite]
    return {"max_abs": float(kept.abs().max()) if kept.numel() else 0.0,
            "mean": float(kept.mean()) if kept.numel() else 0.0,
            "nonfinite": int(values.numel() - int(finite.sum()))}


@dataclass
class _Recorder:
    """The entries of the capture so far, and where the engine is: request, step, token."""

    window: Window
    value_cap: int = VALUE_CAP
    entries: list[dict] = field(default_factory=list)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    request: str = ""
    prompt_len: int = 0
    step: int = -1
    token: int = 0
    rows: int = 0  # the step's padded token rows
    real: int = 0  # of those, the real tokens (the first ones)

    def start_request(self, request_id: str, prompt_len: int) -> None:
        self.request, self.prompt_len, self.step = request_id, prompt_len, -1

    def start_step(self, module, args: tuple, kwargs: dict) -> None:
        batch = args[0] if args else kwargs["batch"]
        self.step += 1
        self.token = int(batch.positions.max()) - self.prompt_len + 1
        self.rows, self.real = batch.positions.shape[0], int(batch.query_start[-1])

    def record(self, layer: str, op: str, output) -> None:
        if not self.window.keeps(self.token):
            return
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for index, tensor in enumerate(outputs):
            if isinstance(tensor, torch.Tensor):
                if tensor.dim() and tensor.shape[0] == self.rows > self.real:
                    tensor = tensor[:self.real]  # a padding token's row is junk, which devices compute differently
                self._add(layer, op if len(outputs) == 1 else f"{op}[{index}]", tensor)

    def _add(self, layer: str, op: str, tensor: torch.Tensor) -> None:
        key = None
        if 0 < tensor.numel() <= self.value_cap:
            key = f"v{len(self.entries)}"
            self.values[key] = tensor.detach().contiguous().cpu().clone()
        self.entries.append({"request": self.request, "step": self.step, "token": self.token, "layer": layer,
                             "op": op, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                             "sha256": digest(tensor), **_stats(tensor), "values": key})


def _recording(table: Ops, layer: str, recorder: _Recorder) -> Ops:
    """`table` with every primitive recording its output under `layer`."""

    def wrap(op: str, fn: Callable) -> Callable:
        def recorded(*args, **kwargs):
            output = fn(*args, **kwargs)
            recorder.record(layer, op, output)
            return output
        return recorded

    primitives = {name: value for name, value in vars(table).items() if callable(value)}
    return Ops(table.numerics, table.device_type, {name: wrap(name, fn) for name, fn in primitives.items()},
               table.row_tiles)


def _holders(model: torch.nn.Module) -> list[tuple[str, object]]:
    """Every object of the model that holds a numerics table, with its name: the modules, and the
    plain objects they keep (the rotary tables)."""
    holders = []
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("ops"), Ops):
            holders.append((name, module))
        for attr, value in vars(module).items():
            if isinstance(getattr(value, "__dict__", {}).get("ops"), Ops) and not isinstance(value, torch.nn.Module):
                holders.append((f"{name}.{attr}" if name else attr, value))
    return holders


def _streams(block_output):
    """A block's output streams (a V4.1 block also returns what its successors reuse)."""
    return block_output[0] if isinstance(block_output, tuple) else block_output


def _run_recorded(llm: LLM, run: Callable[[], None], recorder: _Recorder, tables: Tables | None) -> None:
    """`run()` with every holder of the numerics table given a recording one, then everything put back."""
    model = llm.model
    holders = _holders(model)
    originals = [(holder, holder.ops) for _, holder in holders]
    hooks = [model.register_forward_pre_hook(recorder.start_step, with_kwargs=True)]
    hooks += [module.register_forward_hook(
        lambda _m, _a, out, name=name: recorder.record(name, BLOCK_OUTPUT, _streams(out)))
        for name, module in model.named_modules() if _BLOCK.search(name)]
    try:
        for name, holder in holders:
            table = holder.ops if tables is None else tables(name or "<root>", holder.ops)
            holder.ops = _recording(table, name or "<root>", recorder)
        run()
    finally:
        for holder, table in originals:
            holder.ops = table
        for hook in hooks:
            hook.remove()


def capture(llm: LLM, suite: Suite, request_ids: list[str], window: Window, out: Path, *, run_seed: int = 0,
            value_cap: int = VALUE_CAP, tables: Tables | None = None) -> dict:
    """Run `request_ids` of `suite` one at a time on `llm`'s model and write the capture `out`; returns
    its header. `tables` (tests only) gives each holder of the numerics table the table it runs."""
    if llm.layout.world > 1:
        raise DeepInferError("capture runs on one process: no expert, data or context parallelism")
    by_id = {request.request_id: request for request in suite.requests}
    missing = [rid for rid in request_ids if rid not in by_id]
    if missing:
        raise DeepInferError(f"suite {suite.spec}: no request {missing[0]!r}")
    eager = llm.with_engine(replace(llm.engine_config, cuda_graphs=False, async_scheduling=False,
                                    speculation="off", prefix_caching=False))
    recorder = _Recorder(window, value_cap)
    requests = []
    for rid in request_ids:
        prompt_ids, params = _resolve(eager, by_id[rid], run_seed, window)
        recorder.start_request(rid, len(prompt_ids))
        _run_recorded(eager, lambda: eager.generate([prompt_ids], [params]), recorder, tables)
        requests.append({"id": rid, "prompt_token_ids": prompt_ids, "steps_run": recorder.step + 1})
    header = {"format": FORMAT, "version": VERSION, "model": llm.model_id, "suite": suite.describe(),
              "requests": requests, "window": {"first": window.first, "last": window.last},
              "dtype": str(llm.dtype).removeprefix("torch."), "numerics": llm.numerics, "device": str(llm.device),
              "value_cap": value_cap, "environment": _environment(llm), "entries": recorder.entries}
    write_capture(out, header, recorder.values)
    return header


def _resolve(llm: LLM, request: SuiteRequest, run_seed: int, window: Window):
    """The request's prompt ids and params, generating no further than the window's last token."""
    params = request.params(run_seed, llm)
    return request.prompt_ids(llm), replace(params, max_tokens=min(params.max_tokens, window.last + 1))


def _environment(llm: LLM) -> dict:
    from deepinfer.harness.environment import engine_version

    device = llm.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"engine": engine_version(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device_name": name}


def write_capture(out: Path, header: dict, values: dict[str, torch.Tensor]) -> None:
    """A safetensors file: metadata {"format", "header": JSON}, one tensor per stored output."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    save_file(values, str(partial), metadata={"format": FORMAT, "header": json.dumps(header)})
    partial.replace(out)
