"""`deepinfer audit bisect`: the first op whose outputs differ between two activation captures
(`deepinfer.harness.capture`), and how the difference grows over the later layers of that step."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.audit.errors import AuditError

FORMAT = "deepinfer-activation-capture"  # what harness/capture.py writes
VERSION = 1
BLOCK_OUTPUT = "output"  # the op name under which a block's output is recorded
AMPLIFIED, MAX_AMPLIFIERS = 8.0, 8  # an op whose difference grew past 8x all before it, the first 8 such
_HEADER = ("model", "requests", "dtype", "numerics", "device", "value_cap", "entries")
_KEY = ("request", "step", "layer", "op")  # an entry's place in execution order
_ORDERED_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
                torch.float64: torch.int64}


@dataclass
class Capture:
    path: Path
    header: dict
    values: dict[str, torch.Tensor]

    @property
    def entries(self) -> list[dict]:
        return self.header["entries"]

    def values_of(self, entry: dict) -> torch.Tensor | None:
        return None if entry["values"] is None else self.values[entry["values"]]


def read_capture(path: Path) -> Capture:
    """The capture at `path`; a one-line AuditError for a missing, corrupt or foreign file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise AuditError(f"{path}: not an activation capture (no {FORMAT} header)")
            header = json.loads(metadata["header"])
            values = {key: f.get_tensor(key) for key in f.keys()}
    except AuditError:
        raise
    except Exception as err:  # safetensors, JSON and OS errors alike: the file cannot be read as a capture
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AuditError(f"{path}: not a readable activation capture ({reason})") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        version = header.get("version") if isinstance(header, dict) else None
        raise AuditError(f"{path}: unsupported capture version {version!r} (expected {VERSION})")
    missing = [name for name in _HEADER if name not in header]
    if missing:
        raise AuditError(f"{path}: corrupt capture: its header has no {missing[0]!r}")
    _check_values(path, header, values)
    return Capture(path, header, values)


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes, contiguous, in its own dtype."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()


def _check_values(path: Path, header: dict, values: dict[str, torch.Tensor]) -> None:
    for entry in header["entries"]:
        key = entry["values"]
        if key is not None and (key not in values or digest(values[key]) != entry["sha256"]):
            raise AuditError(f"{path}: corrupt capture: the stored values of {_where(entry)} do not match their digest")


@dataclass
class Difference:
    """Between two outputs: the max abs difference and the max ulp difference (None when not computable:
    values not stored, shapes or dtypes differ)."""

    max_abs: float | None
    max_ulp: int | None

    def describe(self) -> str:
        return f"max abs diff {_num(self.max_abs)}, max ulp diff {'n/a' if self.max_ulp is None else self.max_ulp}"


@dataclass
class Bisection:
    first: tuple[dict, dict] | None  # the first differing entry of each capture; None: no difference
    difference: Difference | None
    growth: list[tuple[str, Difference]]  # (later layer, difference of its output) in that step
    amplifiers: list[tuple[dict, Difference, float]] = field(default_factory=list)  # (op, its difference, the
    # largest before it) where the difference grew past AMPLIFIED times what came before it, in that step


def _where(entry: dict) -> str:
    token = entry["token"]
    made = f"output token {token}" if token >= 0 else f"prefill, {-token} prompt tokens before its last"
    return f"request {entry['request']} step {entry['step']} ({made}) {entry['layer']} {entry['op']}"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6g}"


def difference(a: torch.Tensor | None, b: torch.Tensor | None) -> Difference:
    """Max abs and ulp differences; where both sides hold the same non-finite value (NaN in both: the
    junk rows a step computes for unused capacity) they agree, and a non-finite value against another
    value is an infinite difference."""
    if a is None or b is None or a.shape != b.shape:
        return Difference(None, None)
    if not a.numel():
        return Difference(0.0, 0 if a.dtype == b.dtype else None)
    x, y = a.double(), b.double()
    agree = (x == y) | (torch.isnan(x) & torch.isnan(y))
    finite = torch.isfinite(x) & torch.isfinite(y)
    gaps = torch.where(agree, 0.0, torch.where(finite, (x - y).abs(), float("inf")))
    max_abs = float(gaps.max())
    if a.dtype != b.dtype:
        return Difference(max_abs, None)
    ulps = torch.where(agree, 0, (_ordered(a) - _ordered(b)).abs())
    return Difference(max_abs, int(ulps.max()))


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Integers in the order of the values, one apart for adjacent representable floats."""
    if t.dtype not in _ORDERED_INT:
        return t.long()
    bits = t.contiguous().view(_ORDERED_INT[t.dtype]).long()
    magnitude = bits & ((1 << (8 * t.element_size() - 1)) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def _requests(capture: Capture) -> list[tuple]:
    return [(request["id"], request["prompt_token_ids"]) for request in capture.header["requests"]]


def _check_same_run(a: Capture, b: Capture) -> None:
    if a.header["model"] != b.header["model"]:
        raise AuditError(f"{a.path} and {b.path} are not captures of the same model "
                         f"({a.header['model']} and {b.header['model']})")
    if _requests(a) != _requests(b):
        raise AuditError(f"{a.path} and {b.path} are not captures of the same requests (ids or prompts differ)")


def bisect(a: Capture, b: Capture, above: float = 0.0) -> Bisection:
    """The first op output (in execution order) whose digests differ, or with `above` > 0 the first whose
    max abs difference exceeds it (outputs whose values both captures stored; where a small difference
    became a large one, which may be steps after the first), and the block outputs after it in the same
    step; a one-line AuditError when the captures are not of the same model and requests, or their op
    sequences part before the op is found."""
    _check_same_run(a, b)
    for index, (x, y) in enumerate(zip(a.entries, b.entries)):
        if any(x[k] != y[k] for k in _KEY):
            raise AuditError(f"{a.path} and {b.path} record different op sequences: {_where(x)} against {_where(y)}")
        if x["sha256"] == y["sha256"] and x["dtype"] == y["dtype"] and x["shape"] == y["shape"]:
            continue
        diff = difference(a.values_of(x), b.values_of(y))
        if above and (diff.max_abs is None or diff.max_abs <= above):
            continue
        step = (x["request"], x["step"])
        growth = [(x2["layer"], difference(a.values_of(x2), b.values_of(y2)))
                  for x2, y2 in zip(a.entries[index + 1:], b.entries[index + 1:])
                  if x2["op"] == BLOCK_OUTPUT and all(x2[k] == y2[k] for k in _KEY)
                  and (x2["request"], x2["step"]) == step]
        return Bisection((x, y), diff, growth, _amplifiers(a, b, index, step))
    if len(a.entries) != len(b.entries):
        raise AuditError(f"{a.path} and {b.path} record different op sequences: {len(a.entries)} and "
                         f"{len(b.entries)} op outputs, the common ones identical")
    return Bisection(None, None, [])


def _amplifiers(a: Capture, b: Capture, first: int, step: tuple) -> list[tuple[dict, Difference, float]]:
    """The ops of `step`, from the first difference on, whose outputs differ by more than AMPLIFIED times
    the largest difference of any output before them (values stored on both sides): where a small
    difference became a large one (a rounding flip, a near-tie in a top-k, a quantization step)."""
    found, largest = [], 0.0
    for x, y in zip(a.entries[first:], b.entries[first:]):
        if (x["request"], x["step"]) != step or x["op"] == BLOCK_OUTPUT:
            continue
        diff = difference(a.values_of(x), b.values_of(y))
        if diff.max_abs is None:
            continue
        if largest and diff.max_abs > AMPLIFIED * largest and len(found) < MAX_AMPLIFIERS:
            found.append((x, diff, largest))
        largest = max(largest, diff.max_abs)
    return found


def format_bisection(result: Bisection, a: Capture, b: Capture, above: float = 0.0) -> str:
    if result.first is None:
        if above:
            return f"no difference above {above:g}: no op output of {len(a.entries)} differs by more"
        return f"no difference: {len(a.entries)} op outputs identical"
    x, y = result.first
    what = f"first difference above {above:g}" if above else "first difference"
    lines = [f"{what}: {_where(x)}: {result.difference.describe()}"]
    if x["shape"] != y["shape"] or x["dtype"] != y["dtype"]:
        lines.append(f"  {a.path}: {x['dtype']}{x['shape']}, {b.path}: {y['dtype']}{y['shape']}")
    elif result.difference.max_abs is None:
        lines.append(f"  values not stored (over {a.header['value_cap']} elements): max |x| {_num(x['max_abs'])} "
                     f"against {_num(y['max_abs'])}, mean {x['mean']:.6g} against {y['mean']:.6g}")
    lines.append(f"  {a.header['dtype']} {a.header['numerics']} on {a.header['device']} against "
                 f"{b.header['dtype']} {b.header['numerics']} on {b.header['device']}")
    for entry, diff, before in result.amplifiers:
        lines.append(f"  grew at {entry['layer']} {entry['op']}: max abs diff {_num(diff.max_abs)} (at most "
                     f"{_num(before)} before it)")
    for layer, diff in result.growth:
        lines.append(f"  then {layer}: max abs diff {_num(diff.max_abs)}")
    return "\n".join(lines)
