"""What prompts were rendered with: run manifests record the family's encoding, the deepseek-recipe
version and the tokenizer's content hash; a resumed run, a certificate and a cassette's verification
refuse what was rendered otherwise."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.audit.certificate import build_certificate, seal, verify_certificate, write_certificate
from deepinfer.audit.errors import AuditError
from deepinfer.audit.store import RunStore, file_digests, make_row
from deepinfer.errors import DeepInferError
from deepinfer.harness import run_writer
from deepinfer.harness.cassette import read_cassette, record_cassette, sealed_lines, verify_cassette
from deepinfer.harness.run_writer import open_run, run_manifest
from deepinfer.harness.sweep import Variant

VARIANT = Variant.of("provenance", max_model_len=1024, max_num_seqs=4)
RECIPE = importlib.metadata.version("deepseek-recipe")
SUITE = {"kind": "synthetic", "content_hash": "5" * 64}
EPISODE = {"id": "one", "messages": [{"role": "user", "content": "Oslo or Rome?"},
                                     {"role": "assistant", "content": "Rome."}],
           "sampling": {"temperature": 0, "max_tokens": 3}}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(tiny_checkpoint, VARIANT.engine)


@pytest.fixture(scope="module")
def manifest(llm, tiny_checkpoint) -> dict:
    return run_manifest(llm, tiny_checkpoint, suite=SUITE, run_seed=0, variant=VARIANT.to_dict())


@pytest.fixture(scope="module")
def cassette(llm, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cassette")
    traces = folder / "traces.jsonl"
    traces.write_text(json.dumps(EPISODE) + "\n", encoding="utf-8")
    record_cassette(llm, traces, folder / "cassette.jsonl", mode="free-running", variant=VARIANT)
    return folder / "cassette.jsonl"


# manifests and resumed runs -----------------------------------------------------------------------


def test_a_run_manifest_records_the_encoding_the_recipe_version_and_the_tokenizer(manifest, tiny_checkpoint):
    checkpoint = manifest["checkpoint"]
    assert checkpoint["protocol"] == {"encoding": "v4", "recipe": RECIPE}
    assert checkpoint["tokenizer"]["content_hash"] == hashlib.sha256(
        (tiny_checkpoint / "tokenizer.json").read_bytes()).hexdigest()
    v41 = LLM("preset:v41-tiny", VARIANT.engine)
    assert run_manifest(v41, None, suite=SUITE, run_seed=0, variant={})["checkpoint"]["protocol"] == {
        "encoding": "v41", "recipe": RECIPE}


def test_a_manifest_made_without_deepseek_recipe_records_no_version(llm, monkeypatch):
    def not_installed() -> str:
        raise importlib.metadata.PackageNotFoundError("deepseek-recipe")

    monkeypatch.setattr(run_writer, "recipe_version", not_installed)
    protocol = run_manifest(llm, None, suite=SUITE, run_seed=0, variant={})["checkpoint"]["protocol"]
    assert protocol == {"encoding": "v4", "recipe": None}


@pytest.mark.parametrize(("stored", "problem"), [
    ({"encoding": "v4", "recipe": "0.1.9"},
     f"recorded under the v4 encoding (deepseek-recipe 0.1.9), this invocation renders prompts with the v4 encoding "
     f"(deepseek-recipe {RECIPE})"),
    ({"encoding": "v41", "recipe": RECIPE},
     f"recorded under the v41 encoding (deepseek-recipe {RECIPE}), this invocation renders prompts with the v4 "
     f"encoding (deepseek-recipe {RECIPE})"),
    (None, "its manifest predates the record of the prompt protocol (checkpoint.protocol); record the run again in "
           "a new folder"),
])
def test_resume_refuses_a_run_rendered_with_another_protocol(llm, manifest, tmp_path, stored, problem):
    checkpoint = {key: value for key, value in manifest["checkpoint"].items() if key != "protocol"}
    if stored is not None:
        checkpoint["protocol"] = stored
    RunStore.create(tmp_path / "run", {**manifest, "checkpoint": checkpoint})
    with pytest.raises(AuditError) as err:
        open_run(tmp_path / "run", manifest, llm, resume=True)
    assert str(err.value) == f"{tmp_path / 'run'}: cannot resume: {problem}"
    RunStore.create(tmp_path / "same", manifest)
    assert open_run(tmp_path / "same", manifest, llm, resume=True).done() == set()


# cassettes -----------------------------------------------------------------------------------------


def resealed(cassette: Path, out: Path, edit) -> Path:
    """A copy of `cassette` whose header's manifest.checkpoint went through `edit`, resealed."""
    lines = cassette.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    edit(header["manifest"]["checkpoint"])
    out.write_text("\n".join(sealed_lines(header, lines[1:])) + "\n", encoding="utf-8")
    return out


def test_a_cassette_records_the_protocol(cassette, manifest):
    checkpoint = read_cassette(cassette).header["manifest"]["checkpoint"]
    assert checkpoint["protocol"] == {"encoding": "v4", "recipe": RECIPE}
    assert checkpoint["tokenizer"] == manifest["checkpoint"]["tokenizer"]


def test_verify_refuses_a_cassette_recorded_under_another_encoding(llm, cassette, tmp_path):
    edited = resealed(cassette, tmp_path / "v41.jsonl", lambda c: c["protocol"].update(encoding="v41"))
    with pytest.raises(DeepInferError) as err:
        verify_cassette(llm, read_cassette(edited))
    assert str(err.value) == (f"{edited}: recorded under the v41 encoding (deepseek-recipe {RECIPE}), this engine "
                              "renders prompts with v4: replay it with a v41 checkpoint or record a new cassette")


def test_verify_on_an_engine_of_another_encoding_names_both(cassette):
    v41 = LLM("preset:v41-tiny", VARIANT.engine)
    with pytest.raises(DeepInferError) as err:
        verify_cassette(v41, read_cassette(cassette))
    assert str(err.value) == (f"{cassette}: recorded under the v4 encoding (deepseek-recipe {RECIPE}), this engine "
                              "renders prompts with v41: replay it with a v4 checkpoint or record a new cassette")


def test_verify_refuses_a_protocol_record_without_an_encoding(llm, cassette, tmp_path):
    edited = resealed(cassette, tmp_path / "bad.jsonl", lambda c: c.update(protocol="v4"))
    with pytest.raises(DeepInferError) as err:
        verify_cassette(llm, read_cassette(edited))
    assert str(err.value) == f"{edited}: the header's manifest.checkpoint.protocol names no encoding"


@pytest.mark.parametrize("edit", [
    lambda c: c["protocol"].update(recipe="0.1.9"),  # the prompt hashes are compared turn by turn anyway
    lambda c: c.pop("protocol"),  # recorded before manifests held it
], ids=["another-recipe-version", "recorded-before-the-protocol"])
def test_another_recipe_version_or_no_recorded_protocol_still_verifies(llm, cassette, tmp_path, edit):
    edited = resealed(cassette, tmp_path / "c.jsonl", edit)
    assert [r.status for r in verify_cassette(llm, read_cassette(edited)).results] == ["identical"]


# certificates --------------------------------------------------------------------------------------


def make_run(path: Path, manifest: dict) -> None:
    store = RunStore.create(path, manifest)
    store.append([make_row(i, f"q{i}", [9, 9], {"seed": 1}, [1, 2], [-0.5, -0.5], [[1, 2], [2, 3]],
                           [[-0.5, -2.0], [-0.5, -2.0]], None, "length", None, 0.0, 0.1, 0.2) for i in range(2)])
    store.finalize()


def with_checkpoint(manifest: dict, name: str, **changes) -> dict:
    return {**manifest, "variant": {"name": name}, "checkpoint": {**manifest["checkpoint"], **changes}}


def certify(base: Path, manifest: dict) -> Path:
    configurations = [{"name": name, "role": role, "config": {"name": name}, "run": f"runs/{name}"}
                      for name, role in (("ref", "reference"), ("b", "variant"))]
    cert = build_certificate(out_dir=base, reference="ref", configurations=configurations, suite=SUITE,
                             checkpoint=manifest["checkpoint"], rerun={}, created="2025-01-01T00:00:00+00:00")
    write_certificate(base / "certificate.json", seal(cert))
    return base / "certificate.json"


def test_a_certificate_states_its_runs_protocol_and_tokenizer(manifest, tmp_path):
    for name in ("ref", "b"):
        make_run(tmp_path / "runs" / name, with_checkpoint(manifest, name))
    path = certify(tmp_path, manifest)
    stated = json.loads(path.read_text())["checkpoint"]
    assert stated["protocol"] == {"encoding": "v4", "recipe": RECIPE}
    assert stated["tokenizer"]["content_hash"] == manifest["checkpoint"]["tokenizer"]["content_hash"]
    assert verify_certificate(path) == []


def test_a_certificate_over_runs_of_two_encodings_is_refused(manifest, tmp_path):
    make_run(tmp_path / "runs" / "ref", with_checkpoint(manifest, "ref"))
    make_run(tmp_path / "runs" / "b", with_checkpoint(manifest, "b", protocol={"encoding": "v41", "recipe": RECIPE}))
    with pytest.raises(AuditError) as err:
        certify(tmp_path, manifest)
    assert str(err.value) == (f"configuration 'b': its run rendered prompts with the v41 encoding (deepseek-recipe "
                              f"{RECIPE}), the certified checkpoint states the v4 encoding (deepseek-recipe {RECIPE}); "
                              "a certificate states one: record every configuration with it")


@pytest.mark.parametrize(("changes", "what"), [
    ({"protocol": {"encoding": "v41", "recipe": RECIPE}}, "prompt protocol"),
    ({"protocol": {"encoding": "v4", "recipe": "0.1.9"}}, "prompt protocol"),
    ({"tokenizer": {"content_hash": "0" * 64}}, "tokenizer"),
])
def test_verify_flags_a_run_whose_manifest_disagrees_with_the_certified_protocol(manifest, tmp_path, changes, what):
    """A run swapped in afterwards, its digest re-certified and the certificate resealed, is caught by its manifest."""
    for name in ("ref", "b"):
        make_run(tmp_path / "runs" / name, with_checkpoint(manifest, name))
    path = certify(tmp_path, manifest)
    shutil.rmtree(tmp_path / "runs" / "b")
    make_run(tmp_path / "runs" / "b", with_checkpoint(manifest, "b", **changes))
    cert = json.loads(path.read_text())
    cert["configurations"][1]["files"] = file_digests(tmp_path / "runs" / "b")
    write_certificate(path, seal(cert))
    assert verify_certificate(path) == [
        f"runs/b/manifest.json: its {what} differs from what certificate.json certifies"]
