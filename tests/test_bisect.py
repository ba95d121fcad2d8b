"""`audit capture` / `audit bisect`: a one-ulp difference planted in one op of one layer at one step is
found there; an unplanted pair has none; foreign, corrupt and mismatched captures are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM
from deepinfer.audit.bisect import Difference, bisect, difference, format_bisection, read_capture
from deepinfer.audit.errors import AuditError
from deepinfer.harness.capture import Window, capture
from deepinfer.harness.cli import main
from deepinfer.harness.suite_registry import load_suite
from deepinfer.kernels import Ops
from deepinfer.model.batch import bucket

PLANTED_LAYER, PLANTED_OP, PLANTED_STEP = "model.layers.1.attn_norm", "collapsed_norm", 1
AMPLIFIED_LAYER = "model.layers.3.attn_norm"
REQUESTS = [{"id": "greedy", "prompt_token_ids": [5, 17, 99, 3], "sampling": {"temperature": 0, "max_tokens": 8}},
            {"id": "sampled", "prompt_token_ids": [7, 8], "sampling": {"temperature": 0.7, "seed": 3, "max_tokens": 8}}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("preset:tiny")


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "suite.jsonl"
    path.write_text("".join(json.dumps(request) + "\n" for request in REQUESTS))
    return path


def _planting(layer: str, table: Ops, at_layer: str, change) -> Ops:
    """`table`, except that in `at_layer` the PLANTED_STEP-th call of PLANTED_OP has its first element
    changed by `change`."""
    if layer != at_layer:
        return table
    calls = []
    exact = getattr(table, PLANTED_OP)

    def planted(*args, **kwargs):
        out = exact(*args, **kwargs)
        calls.append(None)
        if len(calls) - 1 == PLANTED_STEP:
            out = out.clone()
            out.view(-1)[0] = change(out.view(-1)[0])
        return out

    primitives = {name: value for name, value in vars(table).items() if callable(value)}
    return Ops(table.numerics, table.device_type, {**primitives, PLANTED_OP: planted}, table.row_tiles)


def _perturbed(layer: str, table: Ops) -> Ops:
    """One ulp up in PLANTED_LAYER's PLANTED_OP at PLANTED_STEP."""
    return _planting(layer, table, PLANTED_LAYER, lambda x: torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype)))


def _amplified(layer: str, table: Ops) -> Ops:
    """The ulp of `_perturbed`, and two layers on, at the same op and step, a jump of 0.5."""
    table = _perturbed(layer, table)
    return _planting(layer, table, AMPLIFIED_LAYER, lambda x: x + 0.5)


def _capture(llm: LLM, suite_file: Path, out: Path, requests=("greedy",), window=Window.steps(2), tables=None):
    capture(llm, load_suite(str(suite_file)), list(requests), window, out, tables=tables)
    return read_capture(out)


def test_a_planted_ulp_is_found_at_its_step_layer_and_op(llm, suite_file, tmp_path) -> None:
    plain = _capture(llm, suite_file, tmp_path / "plain.cap")
    planted = _capture(llm, suite_file, tmp_path / "planted.cap", tables=_perturbed)
    result = bisect(plain, planted)
    first, _ = result.first
    assert (first["request"], first["step"], first["layer"], first["op"]) == (
        "greedy", PLANTED_STEP, PLANTED_LAYER, PLANTED_OP)
    assert result.difference.max_ulp == 1 and result.difference.max_abs > 0
    layers = [layer for layer, _ in result.growth]
    assert layers == [f"model.layers.{i}" for i in range(1, llm.config.num_hidden_layers)]
    assert all(diff.max_abs is not None and diff.max_abs > 0 for _, diff in result.growth)
    text = format_bisection(result, plain, planted)
    assert text.splitlines()[0].startswith(f"first difference: request greedy step {PLANTED_STEP} ")
    assert f"{PLANTED_LAYER} {PLANTED_OP}: " in text and "max ulp diff 1" in text
    assert main(["audit", "bisect", str(tmp_path / "plain.cap"), str(tmp_path / "planted.cap")]) == 1


def test_where_a_small_difference_became_a_large_one_is_named(llm, suite_file, tmp_path) -> None:
    plain = _capture(llm, suite_file, tmp_path / "plain.cap")
    amplified = _capture(llm, suite_file, tmp_path / "amplified.cap", tables=_amplified)
    result = bisect(plain, amplified)
    assert result.first[0]["layer"] == PLANTED_LAYER and result.difference.max_ulp == 1
    grew = [(entry["layer"], entry["op"]) for entry, _, _ in result.amplifiers]
    assert (AMPLIFIED_LAYER, PLANTED_OP) in grew
    jump = next(diff for entry, diff, _ in result.amplifiers if entry["layer"] == AMPLIFIED_LAYER)
    assert jump.max_abs >= 0.5 * (1 - 1e-6)
    assert all(diff.max_abs > 8 * before for _, diff, before in result.amplifiers)
    assert f"  grew at {AMPLIFIED_LAYER} {PLANTED_OP}: " in format_bisection(result, plain, amplified)


def test_above_names_where_the_difference_passed_a_threshold_not_the_first_ulp(llm, suite_file, tmp_path,
                                                                             capsys) -> None:
    plain = _capture(llm, suite_file, tmp_path / "plain.cap")
    amplified = _capture(llm, suite_file, tmp_path / "amplified.cap", tables=_amplified)
    result = bisect(plain, amplified, above=0.25)
    first, _ = result.first
    assert (first["step"], first["layer"], first["op"]) == (PLANTED_STEP, AMPLIFIED_LAYER, PLANTED_OP)
    assert result.difference.max_abs >= 0.5 * (1 - 1e-6)
    argv = ["audit", "bisect", str(tmp_path / "plain.cap"), str(tmp_path / "amplified.cap")]
    assert main([*argv, "--above", "0.25"]) == 1
    assert capsys.readouterr().out.startswith(f"first difference above 0.25: request greedy step {PLANTED_STEP} "
                                              f"(output token {PLANTED_STEP}) {AMPLIFIED_LAYER} {PLANTED_OP}: ")
    assert main([*argv, "--above", "1000"]) == 0
    assert capsys.readouterr().out.startswith("no difference above 1000: no op output of ")
    assert main([*argv, "--above", "-1"]) == 2
    assert capsys.readouterr().err == "error: flags: --above takes a difference >= 0\n"


def test_the_value_cap_decides_which_outputs_keep_their_values(suite_file, tmp_path, capsys) -> None:
    out = tmp_path / "small.cap"
    assert main(["audit", "capture", "--model", "preset:tiny", "--suite", str(suite_file), "--requests", "greedy",
                 "--steps", "1", "--value-cap", "16", "--out", str(out)]) == 0
    small = read_capture(out)
    assert small.header["value_cap"] == 16
    assert {e["values"] is not None for e in small.entries} == {True, False}
    assert all((e["values"] is not None) == (0 < torch.Size(e["shape"]).numel() <= 16) for e in small.entries)
    capsys.readouterr()
    assert main(["audit", "capture", "--model", "preset:tiny", "--suite", str(suite_file), "--requests", "greedy",
                 "--value-cap", "-1", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "error: flags: --value-cap takes a number of elements >= 0\n"


def test_v41_cache_formats_are_ops_a_capture_names(v41_checkpoint, suite_file, tmp_path) -> None:
    """What the release's cache formats do to the values is recorded where it happens (the window KV in
    FP8, compressed KV in NVFP4, indexer keys and queries in MXFP4); with the formats off, nothing."""
    ops = {}
    for qdq in (True, False):
        llm = LLM(str(v41_checkpoint), cache_qdq=qdq)
        found = _capture(llm, suite_file, tmp_path / f"{qdq}.cap", window=Window.steps(1))
        ops[qdq] = {(e["layer"].split(".")[-1], e["op"]) for e in found.entries if e["op"].endswith("_qdq")}
    assert {op for _, op in ops[True]} == {"fp8_ue8m0_qdq", "nvfp4_qdq", "mxfp4_qdq"}
    assert ("attn", "fp8_ue8m0_qdq") in ops[True] and ("indexer", "mxfp4_qdq") in ops[True]
    assert ops[False] == set()


def test_an_unplanted_pair_has_no_difference_and_the_model_is_left_as_it_was(llm, suite_file, tmp_path, capsys) -> None:
    tables = {name: module.ops for name, module in llm.model.named_modules() if "ops" in vars(module)}
    a = _capture(llm, suite_file, tmp_path / "a.cap", requests=("greedy", "sampled"))
    b = _capture(llm, suite_file, tmp_path / "b.cap", requests=("greedy", "sampled"))
    assert bisect(a, b).first is None
    assert format_bisection(bisect(a, b), a, b).startswith("no difference")
    assert {(e["request"], e["step"]) for e in a.entries} == {(r, s) for r in ("greedy", "sampled") for s in range(3)}
    assert all(module.ops is tables[name] for name, module in llm.model.named_modules() if "ops" in vars(module))
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in llm.model.modules())
    assert main(["audit", "bisect", str(tmp_path / "a.cap"), str(tmp_path / "b.cap")]) == 0
    assert capsys.readouterr().out.startswith("no difference")


def test_the_capture_command_with_around_keeps_only_the_steps_near_a_position(suite_file, tmp_path, capsys) -> None:
    out = tmp_path / "around.cap"
    assert main(["audit", "capture", "--model", "preset:tiny", "--suite", str(suite_file), "--requests", "greedy",
                 "--around", "4", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"capture {out}: ")
    around = read_capture(out)
    assert sorted({e["token"] for e in around.entries}) == [2, 3, 4, 5, 6]
    assert around.header["requests"][0]["steps_run"] == 7  # generation stops at the window's last token


def test_padding_rows_are_left_out_of_what_a_capture_keeps(llm, suite_file, tmp_path) -> None:
    """A step pads its tokens to a bucket (5 to 8): its per-token outputs keep the 5 real rows only."""
    assert bucket(5) == 8
    found = _capture(llm, load_suite_lines(tmp_path, [{"id": "five", "prompt_token_ids": [5, 17, 99, 3, 8],
                                                        "sampling": {"temperature": 0, "max_tokens": 2}}]),
                     tmp_path / "five.cap", requests=("five",))
    prefill = [e for e in found.entries if e["step"] == 0]
    assert any(e["shape"][0] == 5 for e in prefill if e["op"] == "rms_norm")
    assert not any(e["shape"] and e["shape"][0] == 8 for e in prefill)


def load_suite_lines(tmp_path: Path, requests: list[dict]) -> Path:
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    return path


def test_captures_of_different_requests_are_refused(llm, suite_file, tmp_path) -> None:
    a = _capture(llm, suite_file, tmp_path / "a.cap", requests=("greedy",))
    b = _capture(llm, suite_file, tmp_path / "b.cap", requests=("sampled",))
    with pytest.raises(AuditError, match="not captures of the same requests"):
        bisect(a, b)


def test_foreign_and_corrupt_files_are_refused(llm, suite_file, tmp_path) -> None:
    from safetensors.torch import save_file

    _capture(llm, suite_file, tmp_path / "good.cap")
    data = (tmp_path / "good.cap").read_bytes()
    (tmp_path / "truncated.cap").write_bytes(data[: len(data) // 2])
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.cap"))
    (tmp_path / "text.cap").write_text("hello")
    for name in ("truncated.cap", "foreign.cap", "text.cap", "missing.cap"):
        with pytest.raises(AuditError) as err:
            read_capture(tmp_path / name)
        assert "\n" not in str(err.value) and name in str(err.value)
    header_end = 8 + int.from_bytes(data[:8], "little")
    flipped = bytearray(data)
    flipped[header_end + 5] ^= 1  # one bit of the stored values
    (tmp_path / "flipped.cap").write_bytes(bytes(flipped))
    with pytest.raises(AuditError, match="corrupt capture"):
        read_capture(tmp_path / "flipped.cap")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_differences_count_representable_values_across_zero(dtype) -> None:
    zero = torch.zeros(3, dtype=dtype)
    up = torch.nextafter(zero, torch.ones(3, dtype=dtype))
    down = torch.nextafter(zero, -torch.ones(3, dtype=dtype))
    assert difference(zero, up).max_ulp == 1
    assert difference(down, up).max_ulp == 2
    assert difference(zero, zero.to(torch.float64)).max_ulp is None


def test_non_finite_values_agree_with_themselves_and_differ_infinitely_from_others() -> None:
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([nan, inf, 1.0, -inf])
    assert difference(a, a.clone()) == Difference(0.0, 0)
    assert difference(a, torch.tensor([nan, inf, 1.5, -inf])).max_abs == 0.5
    assert difference(a, torch.tensor([0.0, inf, 1.0, -inf])).max_abs == inf
    assert difference(a, torch.tensor([nan, -inf, 1.0, -inf])).max_abs == inf
