"""The audit harness on a DeepSeek-V4.1 checkpoint in the release's formats (`v41_checkpoint`: v41-tiny,
FP8 dense weights, MXFP4 experts), end to end through the command lines, unchanged from V4:

- `deepinfer audit certify` (small suite and sweep of test_harness_cli) is BITWISE_REPRODUCIBLE, its
  certificate verifies (also with --rerun), and every run manifest records the QDQ switch; with the
  caches kept in full precision (`cache_qdq: false` in the sweep) the roots change and the verdict holds;
- `deepinfer audit replay record|verify` of agent transcripts in the OpenAI Chat Completions (the long
  tau-bench-like one), Anthropic and Responses shapes verifies, and a tampered tape does not; a tape
  recorded with --no-cache-qdq replays with its switch;
- `deepinfer lm-eval` (lm-eval's own command line) on the user task folder of test_lm_eval_cli gives the
  same per-sample responses and the same run (root and per-request hashes) at batch sizes 1 and 8
  (`slow`: each command line indexes lm-eval's ~15,000 tasks, 12 s of a CPU; test_lm_eval_cli runs the
  same command lines on V4, the adapter knows no family, and test_invariance_v41 holds V4.1's bits at
  every batch size).

Recording is done once per module in fixtures; the tests check what they recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer.audit.store import check_run, read_run
from deepinfer.harness.cli import main
from deepinfer.kernels.cpu_isa import cpu_threads
from test_harness_cli import SUITE, SWEEP, audit, signed_by, write_lines
from test_replay import edit_cassette

TRACES = Path(__file__).parent / "fixtures" / "traces"
VERDICT = ("verdict: BITWISE_REPRODUCIBLE over all 4 requests; {variants} vs reference ref: "
           "0 request divergences, 0 logprob-only drifts")
# SWEEP's reference and one variant with the caches in full precision (variants inherit the reference's setting)
NO_QDQ_SWEEP = {"reference": {**SWEEP["reference"], "cache_qdq": False},
                "variants": [{"name": "batch-1", "max_num_seqs": 1}]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """PyTorch on one CPU thread here: the tiny model gains nothing from more, and on a shared machine
    (other test runs on its 2 cores) two threads each made these runs several times slower."""
    with cpu_threads(1):
        yield


def quiet_main(argv: list) -> tuple[int, str]:
    """`deepinfer ARGV` in a module fixture (no capsys there): exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def configurations(cert_path: Path) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(cert_path.read_text())["configurations"]}


def manifest(folder: Path, name: str) -> dict:
    return json.loads((folder / "runs" / name / "manifest.json").read_text())


def test_the_fixture_is_a_v41_checkpoint_in_the_released_formats(v41_checkpoint):
    config = json.loads((v41_checkpoint / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41"
    assert (config["quantization_config"]["quant_method"], config["quantization_config"]["expert_dtype"]) == (
        "fp8", "fp4")


# --- certify ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certified(tmp_path_factory, v41_checkpoint) -> SimpleNamespace:
    """A signed certification of SUITE under SWEEP (QDQ on, the default), and one under NO_QDQ_SWEEP
    (read-only: copy before changing)."""
    base = tmp_path_factory.mktemp("certified-v41")
    suite = write_lines(base / "suite.jsonl", SUITE)
    keys = base / "signer"
    assert quiet_main(["audit", "keygen", "--out", keys])[0] == 0
    done = {}
    for name, sweep in (("qdq", SWEEP), ("no-qdq", NO_QDQ_SWEEP)):
        (base / f"{name}.json").write_text(json.dumps(sweep))
        code, stdout = quiet_main(["audit", "certify", "--model", v41_checkpoint, "--suite", suite, "--sweep",
                                   base / f"{name}.json", "--out", base / name, "--sign-key", f"{keys}.key",
                                   "--no-progress"])
        done[name] = SimpleNamespace(code=code, stdout=stdout, out=base / name, cert=base / name / "certificate.json")
    return SimpleNamespace(**{k.replace("-", "_"): v for k, v in done.items()}, pub=Path(f"{keys}.pub"))


def test_certify_is_bitwise_reproducible_and_the_certificate_verifies(capsys, certified):
    run = certified.qdq
    assert run.code == 0
    lines = run.stdout.splitlines()
    assert lines[0] == VERDICT.format(variants="2 variants")
    assert lines[1].startswith("control fast: ")
    assert lines[2] == f"certificate: {run.cert}"
    cert = json.loads(run.cert.read_text())
    assert cert["verdict"] == "BITWISE_REPRODUCIBLE" and cert["reference"] == "ref"
    assert [c["name"] for c in cert["controls"]] == ["fast"]
    configs = configurations(run.cert)
    for name in ("batch-1", "chunk-16"):
        assert (configs[name]["token_root"], configs[name]["logit_root"]) == (
            configs["ref"]["token_root"], configs["ref"]["logit_root"])
        assert configs[name]["comparison"] == {"equal": 4, "logprob_drift": 0, "diverged": 0, "near_tie": 0,
                                               "missing": 0, "error": 0}
    for name in configs:
        assert check_run(run.out / "runs" / name) == [], name
    code, out, err = audit(capsys, "verify", run.cert)
    assert (code, out, err) == (0, f"OK: {run.cert} is intact\n{signed_by(certified.pub)}, not pinned: pass "
                                   "--public-key to require it\n", "")


def test_verify_rerun_reproduces_the_reference_bit_for_bit(capsys, certified, tmp_path):
    cert = Path(shutil.copytree(certified.qdq.out, tmp_path / "cert")) / "certificate.json"
    code, out, err = audit(capsys, "verify", cert, "--rerun", "--no-progress")
    assert (code, err) == (0, "")
    assert out.startswith(f"OK: {cert} is intact and its reference run reproduces bit for bit\n")


def test_every_run_manifest_records_the_qdq_switch(certified):
    for run, qdq in ((certified.qdq, True), (certified.no_qdq, False)):
        for name, entry in configurations(run.cert).items():
            recorded = manifest(run.out, name)
            assert (recorded["engine"]["cache_qdq"], recorded["variant"]["cache_qdq"]) == (qdq, qdq), name
            assert entry["config"]["cache_qdq"] is qdq, name


def test_without_qdq_the_numerics_change_and_stay_bitwise_reproducible(certified):
    run = certified.no_qdq
    assert run.code == 0
    assert run.stdout.splitlines()[0] == VERDICT.format(variants="1 variant")
    assert json.loads(run.cert.read_text())["verdict"] == "BITWISE_REPRODUCIBLE"
    plain, qdq = configurations(run.cert), configurations(certified.qdq.cert)
    assert (plain["batch-1"]["token_root"], plain["batch-1"]["logit_root"]) == (
        plain["ref"]["token_root"], plain["ref"]["logit_root"])
    # same suite, run seed and batch as the QDQ reference: only the cache formats differ
    assert plain["ref"]["config"] == {**qdq["ref"]["config"], "cache_qdq": False}
    assert plain["ref"]["logit_root"] != qdq["ref"]["logit_root"]
    assert plain["ref"]["token_root"] != qdq["ref"]["token_root"]


def test_manifests_record_the_model_family_and_formats(certified, v41_checkpoint):
    recorded = manifest(certified.qdq.out, "ref")
    assert recorded["checkpoint"]["family"] == "deepseek_v41"
    assert recorded["checkpoint"]["formats"] == {"dense": "fp8_e4m3 32x32 ue8m0", "routed_experts": "mxfp4 1x32 ue8m0",
                                                 "engram_tables": "fp8_e4m3 1x32 ue8m0", "other": "float32"}
    assert recorded["engine"]["weight_storage"] == "decoded"  # auto, resolved on a CPU
    tokenizer = recorded["checkpoint"]["tokenizer"]
    assert tokenizer["provenance"] == "the checkpoint's tokenizer.json" and tokenizer["vocab_size"] == 1024
    assert tokenizer["content_hash"] == hashlib.sha256(
        (v41_checkpoint / "tokenizer.json").read_bytes()).hexdigest()


# --- replay ----------------------------------------------------------------------------------------------

# (name, trace file, first line only, mode): the long Chat Completions transcript (12 messages, 5 turns)
# teacher-forced; Anthropic teacher-forced and free-running (it offers a server tool, which DeepSeek's API
# refuses: every turn is a counted error); Responses free-running.
SHAPES = [
    ("openai-chat", "tau_customer_service_chat.jsonl", True, "teacher-forced"),
    ("anthropic", "claude_tool_use_anthropic.jsonl", False, "teacher-forced"),
    ("anthropic-free", "claude_tool_use_anthropic.jsonl", False, "free-running"),
    ("responses", "toolbench_legacy_responses.jsonl", False, "free-running"),
]


@pytest.fixture(scope="module")
def tapes(tmp_path_factory, v41_checkpoint) -> dict[str, Path]:
    """A cassette per shape in SHAPES, and 'responses-no-qdq': the Responses one with --no-cache-qdq."""
    base = tmp_path_factory.mktemp("tapes-v41")
    recorded = {}
    for name, file, first_only, mode in SHAPES:
        traces = TRACES / file
        if first_only:
            traces = base / file
            traces.write_text((TRACES / file).read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
        flags = [["--mode", mode]] + ([["--mode", mode, "--no-cache-qdq"]] if name == "responses" else [])
        for extra in flags:
            tape = base / f"{name}{'-no-qdq' if '--no-cache-qdq' in extra else ''}.jsonl"
            code, out = quiet_main(["audit", "replay", "record", "--traces", traces, "--out", tape, "--model",
                                    v41_checkpoint, *extra])
            assert code == 0 and out.splitlines()[-1] == f"cassette: {tape}", out
            recorded[tape.stem] = tape
    return recorded


def cassette_lines(tape: Path) -> tuple[dict, list[dict]]:
    header, *lines = tape.read_text(encoding="utf-8").splitlines()
    return json.loads(header), [json.loads(line) for line in lines]


@pytest.mark.parametrize("name", [shape[0] for shape in SHAPES])
def test_a_replayed_transcript_verifies(capsys, tapes, name):
    header, lines = cassette_lines(tapes[name])
    assert header["manifest"]["engine"]["cache_qdq"] is True
    assert main(["audit", "replay", "verify", str(tapes[name])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(lines) + 2  # one line per episode, the summary, the prefill cost
    for line, result in zip(lines, out):
        assert result.startswith(f"{line['id']}: identical ("), result
    refused = "; 1 of them ended where the engine refused a turn's prompt" if name.startswith("anthropic") else ""
    assert out[len(lines)].endswith(f"{len(lines)} identical{refused}")
    if name == "openai-chat":
        assert out[0] == f"{lines[0]['id']}: identical (5 turn(s) reproduced bit for bit)"
    if name == "anthropic":  # the server tool is refused again, as recorded
        assert out[0] == (f"{lines[0]['id']}: identical (0 turn(s) reproduced bit for bit, then refused again at "
                          "turn 1: invalid_request: not a messages request the recipe accepts: tools[3]: server tools "
                          "are not supported)")


def test_free_running_refuses_a_transcript_with_a_server_tool_naming_it(tapes):
    """A transcript offering a provider's server tool ends free-running at its first turn as an error (the
    command still writes its cassette), with the recipe's reason and no path."""
    _, [line] = cassette_lines(tapes["anthropic-free"])
    outcome = line["recorded"]["outcome"]
    assert (outcome["status"], outcome["turn"]) == ("error", 1)
    assert outcome["detail"] == ("invalid_request: not a messages request the recipe accepts: tools[3]: server tools "
                                 "are not supported")


@pytest.mark.parametrize("name", ["openai-chat", "responses"])  # one teacher-forced, one free-running tape
def test_a_tampered_tape_fails_at_the_tampered_turn(capsys, tapes, tmp_path, name):
    tape = Path(shutil.copy(tapes[name], tmp_path / "tampered.jsonl"))
    _, lines = cassette_lines(tape)
    target = lines[0]
    turn = [t for t in target["recorded"]["turns"] if t["token_ids"]][-1]  # the last turn that generated

    def change_a_token(line: dict) -> None:
        recorded = next(t for t in line["recorded"]["turns"] if t["turn"] == turn["turn"])
        recorded["token_ids"][0] = (recorded["token_ids"][0] + 1) % 1024

    edit_cassette(tape, {target["id"]: change_a_token})
    assert main(["audit", "replay", "verify", str(tape)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{target['id']}: diverged at turn {turn['turn']} token 0 (margin "), out[0]


def test_a_tape_recorded_without_qdq_replays_without_it(capsys, tapes):
    plain_header, plain = cassette_lines(tapes["responses-no-qdq"])
    qdq_header, qdq = cassette_lines(tapes["responses"])
    assert (plain_header["manifest"]["engine"]["cache_qdq"], qdq_header["manifest"]["engine"]["cache_qdq"]) == (
        False, True)
    assert plain_header["manifest"]["variant"]["cache_qdq"] is False
    # the first turn's prompt is the same; what the model computed from it is not
    first = [(line["recorded"]["turns"][0]["prompt_hash"], line["recorded"]["turns"][0]["logit_hash"])
             for line in (plain[0], qdq[0])]
    assert first[0][0] == first[1][0] and first[0][1] != first[1][1]
    assert main(["audit", "replay", "verify", str(tapes["responses-no-qdq"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith(f"{entry['id']}: identical (") for line, entry in zip(out, plain))


# --- lm-eval ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_eval_runs(tmp_path_factory, v41_checkpoint) -> SimpleNamespace:
    """`deepinfer lm-eval` on the user task folder at --batch_size 1 and 8 (both at once: each CLI run
    spends most of its time indexing lm-eval's tasks), each also recording its run (model_args run_dir)."""
    pytest.importorskip("lm_eval")
    from test_lm_eval_cli import TASKS, lm_eval_cli

    base = tmp_path_factory.mktemp("lm-eval-v41")
    tasks = shutil.copytree(TASKS, base / "my tasks")
    (base / "elsewhere").mkdir()

    def evaluate(size: int) -> tuple[int, str, str]:
        return lm_eval_cli(base / "elsewhere", "--model", "deepinfer", "--tasks", "my_tasks", "--include_path",
                           str(tasks), "--device", "cpu", "--model_args",
                           f"model={v41_checkpoint},run_dir={base / f'run{size}'}", "--batch_size", str(size),
                           "--output_path", str(base / f"out{size}"), "--log_samples")

    with ThreadPoolExecutor(2) as pool:
        done = dict(zip((1, 8), pool.map(evaluate, (1, 8))))
    return SimpleNamespace(base=base, done=done)


@pytest.mark.slow
def test_lm_eval_completes_and_a_second_run_gives_identical_samples(lm_eval_runs):
    from test_lm_eval_cli import responses, results

    base = lm_eval_runs.base
    for size, (code, stdout, stderr) in lm_eval_runs.done.items():
        assert code == 0, stderr[-2000:]
        assert "pets_mc" in stdout and "count_gen" in stdout  # lm-eval's results table
    one, eight = results(base / "out1"), results(base / "out8")
    assert set(one["results"]) == {"pets_mc", "count_gen"}
    assert one["results"] == eight["results"]
    assert (one["config"]["engine_batch_size"], eight["config"]["engine_batch_size"]) == (1, 8)
    for task in ("pets_mc", "count_gen"):
        assert responses(base / "out1", task) == responses(base / "out8", task)
        assert len(responses(base / "out1", task)) == 4


@pytest.mark.slow
def test_lm_eval_runs_are_identical_request_by_request_and_record_the_qdq_switch(lm_eval_runs):
    base = lm_eval_runs.base
    runs = [read_run(base / f"run{size}") for size in (1, 8)]
    for size in (1, 8):
        assert check_run(base / f"run{size}") == []
        recorded = json.loads((base / f"run{size}" / "manifest.json").read_text())
        assert recorded["engine"]["cache_qdq"] is True and recorded["engine"]["max_num_seqs"] == size
    assert runs[0].root == runs[1].root and runs[0].root["count"] == 16
    columns = ["request_id", "prompt_hash", "token_hash", "logit_hash"]
    assert runs[0].streams.select(columns).to_dicts() == runs[1].streams.select(columns).to_dicts()
