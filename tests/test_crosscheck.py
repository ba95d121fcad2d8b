"""`deepinfer audit crosscheck`: runs of the smoke suite's first 8 requests under two CPU library code
paths (the default one in this process, the AVX2-only CPU's in a child: `harness/cpu_paths.py`) and in
bf16, classified request by request against the first; the crosscheck is sealed, verifies, fails
verification once a class count is changed (re-sealed or not), and its report has a section per pair."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from deepinfer.audit.certificate import generate_keypair, seal
from deepinfer.audit.compare import compare_streams
from deepinfer.audit.crosscheck import (CLASSES, CROSSCHECK, load_crosscheck, request_classes, verify_crosscheck,
                                        where_it_ran)
from deepinfer.audit.files import json_bytes
from deepinfer.audit.store import read_run
from deepinfer.harness.cli import main
from deepinfer.harness.cpu_paths import LIBRARY_PATHS, PATH_VARIABLES

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("crosscheck")
    suite = base / "suite.jsonl"
    suite.write_text("".join((ROOT / "harness" / "suites" / "smoke.jsonl").read_text().splitlines(True)[:8]))
    common = ["audit", "run", "--model", str(tiny_checkpoint), "--suite", str(suite), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in PATH_VARIABLES} | LIBRARY_PATHS["avx2-cpu"]
    child = subprocess.run([sys.executable, "-m", "deepinfer", *common, "--out", str(base / "avx2")], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    for name, flags in (("default", []), ("bf16", ["--dtype", "bfloat16"])):
        assert main([*common, "--out", str(base / name), *flags]) == 0
    return {name: base / name for name in ("default", "avx2", "bf16")}


@pytest.fixture(scope="module")
def crosschecked(runs, tmp_path_factory) -> tuple[Path, int, str]:
    out = tmp_path_factory.mktemp("crosschecked") / "out"
    key = tmp_path_factory.mktemp("key") / "signer.key"
    key.write_bytes(generate_keypair()[0])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["audit", "crosscheck", str(runs["default"]), f"avx2-cpu={runs['avx2']}", str(runs["bf16"]),
                     "--out", str(out), "--sign-key", str(key)])
    return out, code, printed.getvalue()


def test_every_request_of_every_pair_is_classified_as_compare_says(runs, crosschecked):
    out, code, printed = crosschecked
    crosscheck = load_crosscheck(out)
    assert code == 0 and [r["name"] for r in crosscheck["runs"]] == ["default", "avx2-cpu", "bf16"]
    reference = read_run(runs["default"]).streams
    for pair, other in zip(crosscheck["pairs"], ("avx2", "bf16")):
        comparison = compare_streams(reference, read_run(runs[other]).streams, crosscheck["near_tie_threshold"])
        classes = request_classes(comparison)
        assert sum(pair["classes"].values()) == pair["requests"] == 8
        assert pair["classes"] == {c: int((classes == c).sum()) for c in CLASSES}
        assert pair["max_logprob_ulps"] == (comparison["max_logprob_ulps"].max() or 0)
        diverged = comparison.filter(pl.col("status") == "diverged")
        assert [(d["request_id"], d["position"]) for d in pair["divergences"]] == list(
            zip(diverged["request_id"], diverged["first_divergence"]))
        for d in pair["divergences"]:
            gaps = [g for g in (d["gap_reference"], d["gap_other"]) if g is not None]
            assert d["near_tie"] == (min(gaps, default=float("inf")) < crosscheck["near_tie_threshold"])
    assert "the CPU code path" in printed.splitlines()[0]
    assert crosscheck["pairs"][1]["differs"]["dtype"] == ["float32", "bfloat16"]
    assert crosscheck["pairs"][1]["classes"]["bitwise"] < 8  # bf16 cannot give fp32's bits


def test_pytorchs_own_cpu_kernels_are_part_of_where_a_run_ran():
    """ATEN_CPU_CAPABILITY changes PyTorch's vectorised kernels (norms, softmax, exp) and with them the
    bits, while MKL and oneDNN stay as they were: a pair differing only there must say so."""
    def manifest(capability: str, device: str = "cpu") -> dict:
        return {"variant": {"device": device}, "environment": {"torch_cpu": {"capability": capability}}}

    assert where_it_ran(manifest("AVX2"))["cpu_kernels"] == "AVX2"
    assert where_it_ran(manifest("AVX2", "cuda"))["cpu_kernels"] is None
    differs = {k for k, v in where_it_ran(manifest("AVX2")).items() if where_it_ran(manifest("DEFAULT"))[k] != v}
    assert differs == {"cpu_kernels"}


def test_the_crosscheck_verifies_from_its_own_folder_anywhere(crosschecked, tmp_path, capsys):
    out, _, _ = crosschecked
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    assert verify_crosscheck(moved) == []
    assert main(["audit", "verify", str(moved)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"OK: {moved} is intact"


@pytest.mark.parametrize("reseal", [False, True])
def test_a_tampered_class_count_fails_verification(crosschecked, tmp_path, reseal):
    out, _, _ = crosschecked
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    crosscheck = load_crosscheck(tampered)
    counts = crosscheck["pairs"][0]["classes"]
    moved = next(c for c in CLASSES if counts[c])  # one request said to be of the next class
    counts[moved] -= 1
    counts[CLASSES[(CLASSES.index(moved) + 1) % len(CLASSES)]] += 1
    crosscheck.pop("signature")
    (tampered / CROSSCHECK).write_bytes(json_bytes(seal(crosscheck) if reseal else crosscheck))
    problems = verify_crosscheck(tampered)
    if reseal:
        stated = load_crosscheck(out)["pairs"][0]["classes"]
        classes = {c: stated[c] for c in CLASSES}
        assert problems == [f"{CROSSCHECK}: pairs 'default' vs 'avx2-cpu': classes {crosscheck['pairs'][0]['classes']} "
                            f"does not follow from the runs (recomputed {classes})"]
    else:
        assert problems == [f"{CROSSCHECK}: content hash does not match its contents (edited after sealing?)"]


def test_a_changed_run_file_fails_verification(crosschecked, tmp_path):
    out, _, _ = crosschecked
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    manifest = changed / "runs" / "bf16" / "manifest.json"
    manifest.write_text(manifest.read_text().replace("bfloat16", "float32"))
    assert verify_crosscheck(changed)[0] == ("runs/bf16/manifest.json: sha256 does not match the certificate "
                                             "(changed after certification?)")


def test_the_report_has_a_section_per_pair(crosschecked):
    out, _, _ = crosschecked
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "## default vs avx2-cpu" in md and "## default vs bf16" in md
    assert "<h2>default vs bf16</h2>" in html and "dtype: float32 → bfloat16" in md
    drawn = sorted(p.name for p in (out / "report_files").glob("*.png"))
    assert "crosscheck_drift_1.png" in drawn and all(f"report_files/{name}" in md for name in drawn)
    assert "data:image/png;base64," in html


def test_bad_input_is_refused_in_one_line(runs, tmp_path, capsys):
    other_suite = tmp_path / "other.jsonl"
    other_suite.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 2}}) + "\n")
    assert main(["audit", "run", "--model", "preset:tiny", "--suite", str(other_suite), "--no-progress",
                 "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    cases = [
        ([str(runs["default"]), str(tmp_path / "other")], "run 'other' is of suite"),
        ([str(runs["default"]), f"default={runs['avx2']}"], "run names must be unique, got ['default', 'default']: "
                                                            "name them NAME=PATH"),
        ([str(runs["default"]), str(tmp_path / "nowhere")], f"{tmp_path / 'nowhere'}: neither a certificate nor a "
                                                           "run folder"),
    ]
    for given, message in cases:
        out = tmp_path / "out"
        assert main(["audit", "crosscheck", *given, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
        assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    assert main(["audit", "certify-runs", str(runs["default"]), str(tmp_path / "other"), "--out",
                 str(tmp_path / "cert")]) == 2
    assert capsys.readouterr().err.startswith("error: run 'other' is of suite ")
    assert not (tmp_path / "cert").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("mine")
    assert main(["audit", "crosscheck", str(runs["default"]), str(runs["avx2"]), "--out", str(tmp_path / "full")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'full'}: exists and is not an empty folder; a crosscheck is "
                                       "written into a new one\n")
    assert (tmp_path / "full" / "kept.txt").read_text() == "mine"


def test_expect_fails_a_pair_that_falls_short(runs, tmp_path):
    default = str(runs["default"])
    assert main(["audit", "crosscheck", default, str(runs["bf16"]), "--out", str(tmp_path / "a"), "--expect",
                 "tokens"]) == 1
    assert main(["audit", "crosscheck", default, f"again={default}", "--out", str(tmp_path / "b"), "--expect",
                 "bitwise"]) == 0


def test_another_engines_outputs_imported_are_crosschecked_with_ours(runs, tmp_path, capsys):
    """Our run's outputs written as another engine's plain JSONL, imported (`audit import`), then
    crosschecked against our run: every request bitwise, the engine named, no checkpoint to compare."""
    suite = runs["default"].parent / "suite.jsonl"
    lines = [{"request_id": row["request_id"], "prompt_token_ids": row["prompt_token_ids"], "token_ids": row["token_ids"],
              "logprobs": row["logprobs"], "finish_reason": row["finish_reason"],
              "top_logprobs": [list(map(list, zip(ids, lps))) for ids, lps in zip(row["top_token_ids"], row["top_logprobs"])]}
             for row in read_run(runs["default"]).streams.sort("index").iter_rows(named=True)]
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["audit", "import", str(outputs), "--from", "jsonl", "--suite", str(suite), "--out",
                 str(tmp_path / "other-engine")]) == 0
    assert main(["audit", "crosscheck", str(runs["default"]), str(tmp_path / "other-engine"), "--out",
                 str(tmp_path / "out"), "--expect", "bitwise"]) == 0
    [pair] = load_crosscheck(tmp_path / "out")["pairs"]
    assert pair["classes"]["bitwise"] == 8 and pair["differs"]["engine"] == ["deepinfer", None]
    assert verify_crosscheck(tmp_path / "out") == []
