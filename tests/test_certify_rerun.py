"""Tests for `deepinfer audit verify --rerun` finding a certification's inputs after they moved, its
--suite/--model overrides, `certify()` returning the certificate (the command line renders the report),
and certify/run starts that fail leaving --out reusable.

One certification (1 request, a reference and one variant) is made from inside its folder with relative
paths, and then the whole folder is renamed: the absolute paths the certificate records no longer exist,
so every re-run below has to find the suite and the model relative to the certificate (or be told)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer.audit.certificate import seal, write_certificate
from deepinfer.errors import DeepInferError
from deepinfer.harness.cli import main

REPO = Path(__file__).resolve().parent.parent
SUITE = [{"id": "a", "prompt": "Hello there", "sampling": {"temperature": 0, "max_tokens": 3, "ignore_eos": True}}]
SWEEP = {"reference": {"name": "ref", "max_num_seqs": 4}, "variants": [{"name": "b1", "max_num_seqs": 1}]}
RERUN_OK = "is intact and its reference run reproduces bit for bit"


def audit(capsys, *argv: object) -> tuple[int, str, str]:
    code = main(["audit", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(capsys, argv: list, message: str) -> None:
    assert "\n" not in message
    assert audit(capsys, *argv) == (2, "", f"error: {message}\n")


def write_inputs(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    suite, sweep = folder / "suite.jsonl", folder / "sweep.json"
    suite.write_text("".join(json.dumps(r) + "\n" for r in SUITE))
    sweep.write_text(json.dumps(SWEEP))
    return suite, sweep


@pytest.fixture(scope="module")
def moved(tmp_path_factory, tiny_checkpoint) -> SimpleNamespace:
    """ORIG/{model, inputs/suite.jsonl, certs/c} certified from inside ORIG with relative paths, then
    ORIG renamed to MOVED."""
    base = tmp_path_factory.mktemp("rerun")
    orig = base / "orig"
    shutil.copytree(tiny_checkpoint, orig / "model")
    write_inputs(orig / "inputs")
    cwd = Path.cwd()
    os.chdir(orig)
    try:
        code = main(["audit", "certify", "--model", "model", "--suite", "inputs/suite.jsonl", "--sweep",
                     "inputs/sweep.json", "--out", "certs/c", "--no-progress"])
    finally:
        os.chdir(cwd)
    assert code == 0
    rerun = json.loads((orig / "certs" / "c" / "certificate.json").read_text())["rerun"]
    orig.rename(base / "moved")
    folder = base / "moved"
    return SimpleNamespace(orig=orig, folder=folder, cert=folder / "certs" / "c" / "certificate.json",
                           suite=folder / "inputs" / "suite.jsonl", model=folder / "model", rerun=rerun)


def test_the_rerun_block_records_absolute_and_certificate_relative_paths(moved):
    assert moved.rerun["model"] == str((moved.orig / "model").resolve())
    assert moved.rerun["suite"] == f"native:{(moved.orig / 'inputs' / 'suite.jsonl').resolve()}"
    assert moved.rerun["from_certificate"] == {"model": "../../model", "suite": "native:../../inputs/suite.jsonl"}


def test_rerun_finds_moved_inputs_relative_to_the_certificate_from_any_folder(capsys, moved, tmp_path, monkeypatch):
    assert not moved.orig.exists()
    monkeypatch.chdir(tmp_path)  # neither the certification's folder nor where it was typed
    code, out, err = audit(capsys, "verify", moved.cert, "--rerun", "--no-progress")
    assert (code, err) == (0, "") and out.startswith(f"OK: {moved.cert} {RERUN_OK}\n")
    monkeypatch.chdir(moved.cert.parent.parent)  # a relative certificate path, and a folder instead of the file
    code, out, err = audit(capsys, "verify", "c", "--rerun", "--no-progress")
    assert (code, err) == (0, "") and out.startswith(f"OK: c {RERUN_OK}\n")


def test_moved_suite_and_model_are_named_and_found_with_suite_and_model(capsys, moved, tmp_path, monkeypatch):
    cert_dir = tmp_path / "elsewhere" / "c"
    shutil.copytree(moved.cert.parent, cert_dir)  # away from its inputs: neither path leads to them now
    cert = cert_dir / "certificate.json"
    argv = ["verify", cert, "--rerun", "--no-progress"]
    assert_user_error(capsys, argv, f"{cert}: rerun.suite: suite file not found (tried "
                                    f"{tmp_path / 'inputs' / 'suite.jsonl'}, {moved.orig / 'inputs' / 'suite.jsonl'}); "
                                    "pass --suite KIND:PATH to point at it")
    assert_user_error(capsys, [*argv, "--suite", moved.suite],
                      f"{cert}: rerun.model: checkpoint folder not found (tried {tmp_path / 'model'}, "
                      f"{moved.orig / 'model'}); pass --model DIR to point at it")
    monkeypatch.chdir(moved.folder)  # the overrides are paths as typed, relative to the working folder
    code, out, err = audit(capsys, *argv, "--suite", "native:inputs/suite.jsonl", "--model", "model")
    assert (code, err) == (0, "") and out.startswith(f"OK: {cert} {RERUN_OK}\n")


def test_a_suite_override_must_be_the_certified_suite(capsys, moved, tmp_path):
    other, _ = write_inputs(tmp_path)
    other.write_text(json.dumps({**SUITE[0], "prompt": "Goodbye"}) + "\n")
    code, out, err = audit(capsys, "verify", moved.cert, "--rerun", "--no-progress", "--suite", other)
    assert (code, out) == (1, "")
    assert re.fullmatch(rf"FAIL: suite {re.escape(str(other))} has content hash [0-9a-f]{{12}}…, the certificate "
                        r"says [0-9a-f]{12}…\n", err)
    assert_user_error(capsys, ["verify", moved.cert, "--rerun", "--suite", tmp_path / "none.jsonl"],
                      f"suite '{tmp_path / 'none.jsonl'}': no such file")


@pytest.mark.parametrize("flag", ["--model", "--suite"])
def test_overrides_only_apply_with_rerun(capsys, moved, flag):
    assert_user_error(capsys, ["verify", moved.cert, flag, "x"], f"{flag} only applies with --rerun")


@pytest.mark.parametrize("relative", [[], {"model": 1, "suite": None}, "../x"])
def test_a_malformed_from_certificate_is_one_line(capsys, moved, tmp_path, relative):
    shutil.copytree(moved.cert.parent, tmp_path / "c")
    cert = tmp_path / "c" / "certificate.json"
    body = json.loads(cert.read_text())
    write_certificate(cert, seal({**body, "rerun": {**body["rerun"], "from_certificate": relative}}))
    assert_user_error(capsys, ["verify", cert, "--rerun", "--no-progress"],
                      f"{cert}: rerun.from_certificate: not an object of model and suite paths or nulls "
                      "(cannot re-run)")


def test_an_older_certificate_reruns_with_paths_as_typed(capsys, moved, tmp_path, monkeypatch):
    """Certificates made before `from_certificate` recorded the model as typed at certification."""
    shutil.copytree(moved.cert.parent, tmp_path / "c")
    cert = tmp_path / "c" / "certificate.json"
    body = json.loads(cert.read_text())
    rerun = {key: value for key, value in body["rerun"].items() if key != "from_certificate"}
    write_certificate(cert, seal({**body, "rerun": {**rerun, "model": "model", "suite": f"native:{moved.suite}"}}))
    monkeypatch.chdir(moved.folder)
    code, out, err = audit(capsys, "verify", cert, "--rerun", "--no-progress")
    assert (code, err) == (0, "") and out.startswith(f"OK: {cert} {RERUN_OK}\n")
    monkeypatch.chdir(tmp_path)
    assert_user_error(capsys, ["verify", cert, "--rerun", "--no-progress"],
                      f"{cert}: rerun.model: checkpoint folder not found (tried model); "
                      "pass --model DIR to point at it")


def test_another_checkpoint_fails_before_running_and_an_old_default_names_the_way_out(
        capsys, moved, tmp_path, monkeypatch, v41_checkpoint):
    """The checkpoint is hashed before the re-run: a wrong one costs no run. A certificate of the embedded
    default made by an earlier version (whose default was another checkpoint) says to pass --model."""
    import deepinfer.harness.certify
    from deepinfer.checkpoint import DEFAULT_PRESET, content_hash, default_checkpoint

    def no_run(*args, **kwargs):
        raise AssertionError("re-ran with the wrong checkpoint")

    monkeypatch.setattr(deepinfer.harness.certify, "record_run", no_run)
    certified = json.loads(moved.cert.read_text())["checkpoint"]["content_hash"]
    wrong = f"FAIL: the checkpoint's content hash {content_hash(v41_checkpoint)[:12]}… differs from the certified {certified[:12]}…"
    code, out, err = audit(capsys, "verify", moved.cert, "--rerun", "--no-progress", "--model", v41_checkpoint)
    assert (code, out, err) == (1, "", wrong + "\n")
    shutil.copytree(moved.cert.parent, tmp_path / "c")
    cert = tmp_path / "c" / "certificate.json"
    body = json.loads(cert.read_text())
    rerun = {**body["rerun"], "model": None, "from_certificate": {**body["rerun"]["from_certificate"], "model": None}}
    write_certificate(cert, seal({**body, "rerun": {**rerun, "suite": f"native:{moved.suite}"}}))
    code, out, err = audit(capsys, "verify", cert, "--rerun", "--no-progress")
    assert (code, out) == (1, "")
    assert err == (f"FAIL: the checkpoint's content hash {content_hash(default_checkpoint())[:12]}… differs from the "
                   f"certified {certified[:12]}…: the certificate was made with the embedded default checkpoint, "
                   f"which is now {DEFAULT_PRESET}; pass --model DIR with the checkpoint it was made with\n")


# --- certify() and the report ----------------------------------------------------------------------------


def test_the_harness_does_not_import_reports():
    tree = ast.parse((REPO / "harness" / "certify.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name == "reports" or name.startswith("reports.") for name in imported)


# --- failed starts leave --out reusable ------------------------------------------------------------------


def failing_first_run(monkeypatch) -> None:
    """The first configuration's engine fails to start (as a model the engine cannot load would)."""
    import deepinfer.harness.certify

    def fail(*args, **kwargs):
        raise DeepInferError("the engine failed to start")

    monkeypatch.setattr(deepinfer.harness.certify, "record_run", fail)


def test_a_failed_certify_start_leaves_out_as_it_was_and_certify_returns_the_certificate(
        capsys, monkeypatch, tiny_checkpoint, tmp_path):
    from deepinfer.harness.certify import certify
    from deepinfer.harness.sweep import load_sweep

    suite, sweep = write_inputs(tmp_path / "inputs")
    out = tmp_path / "out"
    argv = ["certify", "--model", tiny_checkpoint, "--suite", suite, "--sweep", sweep, "--out", out, "--no-progress"]
    with monkeypatch.context() as patch:
        failing_first_run(patch)
        assert_user_error(capsys, argv, "the engine failed to start")
        assert not out.exists()  # new: removed again
        out.mkdir()
        assert_user_error(capsys, argv, "the engine failed to start")
        assert list(out.iterdir()) == []  # empty: left empty
    cert = certify(tiny_checkpoint, str(suite), load_sweep(sweep), out, progress=False)  # a retry
    assert cert == json.loads((out / "certificate.json").read_text()) and cert["verdict"] == "BITWISE_REPRODUCIBLE"
    assert sorted(p.name for p in out.iterdir()) == ["certificate.json", "runs", "sweep.json"]  # no report


def test_after_a_failed_certify_start_resume_works(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    suite, sweep = write_inputs(tmp_path / "inputs")
    out = tmp_path / "out"
    argv = ["certify", "--model", tiny_checkpoint, "--suite", suite, "--sweep", sweep, "--out", out, "--no-progress"]
    fresh = f"note: {out}: no certification to resume there (no sweep.json); starting a new certification\n"
    with monkeypatch.context() as patch:
        failing_first_run(patch)
        assert audit(capsys, *argv, "--resume") == (2, "", f"{fresh}error: the engine failed to start\n")
    assert not out.exists()
    code, stdout, err = audit(capsys, *argv, "--resume")
    assert (code, err) == (0, fresh)
    assert stdout.splitlines()[-2:] == [f"certificate: {out / 'certificate.json'}",
                                        f"report: {out / 'report.md'} and {out / 'report.html'}"]


def test_a_started_certification_is_kept_for_resume(capsys, monkeypatch, tiny_checkpoint, tmp_path):
    import deepinfer.harness.certify

    suite, sweep = write_inputs(tmp_path / "inputs")
    out = tmp_path / "out"
    argv = ["certify", "--model", tiny_checkpoint, "--suite", suite, "--sweep", sweep, "--out", out, "--no-progress"]
    record_run = deepinfer.harness.certify.record_run

    def reference_only(model, suite, variant, run_dir, **kwargs):
        if variant.name != "ref":
            raise DeepInferError("the variant's engine failed to start")
        return record_run(model, suite, variant, run_dir, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(deepinfer.harness.certify, "record_run", reference_only)
        assert_user_error(capsys, argv, "the variant's engine failed to start")
    assert (out / "runs" / "ref" / "root.json").is_file()
    assert_user_error(capsys, argv, f"{out} is not empty: pass --resume to continue it, or a new output folder")
    assert audit(capsys, *argv, "--resume")[0] == 0


# --- bad flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--threads", "100000"], f"flags: threads must be between 1 and this machine's {os.cpu_count()} CPUs, got 100000"),
    (["--threads", "0"], f"flags: threads must be between 1 and this machine's {os.cpu_count()} CPUs, got 0"),
    (["--device", "tpu"], "flags: unknown device 'tpu' (expected cpu, cuda or cuda:N)"),
    (["--dtype", "float8"], "flags: unknown dtype 'float8' (expected one of "),
])
@pytest.mark.parametrize("command", ["run", "certify"])
def test_bad_engine_flags_of_run_and_certify(capsys, tmp_path, command, flags, message):
    suite, _ = write_inputs(tmp_path / "inputs")
    out = tmp_path / "out"
    code, stdout, err = audit(capsys, command, "--suite", suite, "--out", out, "--no-progress", *flags)
    assert (code, stdout) == (2, "") and err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not out.exists()


def test_certify_without_cuda_refuses_cuda_before_writing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    suite, _ = write_inputs(tmp_path / "inputs")
    assert_user_error(capsys, ["certify", "--suite", suite, "--out", tmp_path / "out", "--device", "cuda:0"],
                      "flags: device 'cuda:0' requested but CUDA is not available")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [["--threads", "1"], ["--device", "cpu"], ["--dtype", "float32"],
                                   ["--expert-parallel", "2"], ["--data-parallel", "2"]])
def test_default_sweep_flags_with_a_sweep_file(capsys, tmp_path, flags):
    suite, sweep = write_inputs(tmp_path / "inputs")
    flag = flags[0]
    setting = flag[2:].replace("-", "_")
    assert_user_error(capsys, ["certify", "--suite", suite, "--sweep", sweep, "--out", tmp_path / "out", *flags],
                      f"{flag} sets the default sweep only: with --sweep, give {setting} in the sweep file's "
                      "configurations")


def test_threads_apply_to_the_default_sweep_except_its_threads_1_variant():
    from deepinfer.harness.cli import _certify_sweep

    sweep = _certify_sweep(SimpleNamespace(sweep=None, dtype=None, device=None, model="preset:tiny",
                                           threads=2 if os.cpu_count() > 1 else 1, expert_parallel=None,
                                           data_parallel=None))
    threads = {variant.name: variant.threads for _, variant in sweep.configurations()}
    assert threads.pop("threads-1") == 1 and set(threads.values()) == {min(2, os.cpu_count())}


def test_out_naming_a_file_is_refused_before_the_model_loads(capsys, tmp_path):
    suite, _ = write_inputs(tmp_path / "inputs")
    (tmp_path / "file").write_text("mine")
    assert_user_error(capsys, ["run", "--model", tmp_path / "no-model", "--suite", suite, "--out", tmp_path / "file"],
                      f"{tmp_path / 'file'}: cannot create a run: it exists and is not a folder")
    assert_user_error(capsys, ["certify", "--model", tmp_path / "no-model", "--suite", suite, "--out",
                               tmp_path / "file"], f"{tmp_path / 'file'}: exists and is not a folder")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_failed_run_start_leaves_out_reusable(capsys, tiny_checkpoint, tmp_path):
    suite, _ = write_inputs(tmp_path / "inputs")
    out = tmp_path / "run"
    argv = ["run", "--suite", suite, "--out", out, "--no-progress"]
    assert_user_error(capsys, [*argv, "--model", tmp_path / "no-model"],
                      f"{tmp_path / 'no-model'}: checkpoint folder not found")
    assert not out.exists()
    assert audit(capsys, *argv, "--model", tiny_checkpoint)[0] == 0
    shutil.rmtree(out)
    assert audit(capsys, *argv, "--model", tmp_path / "no-model", "--resume") == (
        2, "", f"note: {out}: no run to resume there (no manifest.json); starting a new run\n"
               f"error: {tmp_path / 'no-model'}: checkpoint folder not found\n")
    assert audit(capsys, *argv, "--model", tiny_checkpoint, "--resume")[0] == 0
