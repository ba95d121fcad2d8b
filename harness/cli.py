"""The full `deepinfer` command: the engine's commands plus `deepinfer audit ...`.

The audit commands live here, not in deepinfer/, because they drive the harness and the audit store
(dependencies point kernels <- deepinfer <- harness -> audit <- reports).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from deepinfer.audit.errors import AuditError
from deepinfer import cli as engine_cli
from deepinfer.checkpoint import MODEL_HELP
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.errors import DeepInferError
from deepinfer.parallel import process_rank
from deepinfer.harness.bisect_cli import add_bisect_commands
from deepinfer.harness.eval_cli import add_eval_command
from deepinfer.harness.import_cli import add_import_command
from deepinfer.harness.lm_eval_cli import add_lm_eval_command
from deepinfer.harness.replay_cli import add_replay_commands

EXIT_DIFFERENT = 1


def main(argv: Sequence[str] | None = None) -> int:
    return engine_cli.main(argv, more_commands=(add_audit, add_lm_eval_command), user_errors=(AuditError,))


def add_audit(commands: argparse._SubParsersAction) -> None:
    audit = commands.add_parser("audit", help="record, compare and certify runs",
                                description="Record runs into the audit store, compare them, and issue "
                                            "verifiable reproducibility certificates.")
    sub = audit.add_subparsers(title="audit commands", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="record one configuration of a suite into a run folder")
    _model_and_suite(run)
    run.add_argument("--out", required=True, help="run folder to create (or to continue with --resume)")
    run.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    _variant_flags(run)
    run.set_defaults(run=_cmd_run)

    certify = sub.add_parser("certify", help="run a suite over a sweep of configurations and certify it",
                             description="Run the suite under the reference configuration and every variant "
                                         "of the sweep, compare each with the reference, and write "
                                         "certificate.json, report.md and report.html into --out.")
    _model_and_suite(certify)
    certify.add_argument("--sweep", help="sweep JSON file (default: a batch-32 reference, batch 1/3/8, shuffled, "
                                         "staggered, chunks of 16 and 64 and none, preemption, synchronous steps, "
                                         "speculation, the prefix cache cold and hot, three shards, one CPU thread "
                                         "or (CUDA) no graphs, plus a numerics=fast control)")
    certify.add_argument("--out", required=True, help="output folder (must be new or empty unless --resume)")
    certify.add_argument("--resume", action="store_true", help="continue an interrupted certification in --out")
    certify.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the certificate with")
    certify.add_argument("--allow-errors", action="store_true",
                         help="exit 0 even when requests errored (they are still counted in the verdict)")
    certify.add_argument("--dtype", help="dtype of the default sweep (default: float32)")
    certify.add_argument("--device", help="device of the default sweep (default: cpu)")
    certify.add_argument("--expert-parallel", type=int, help="expert_parallel of the default sweep: the number of "
                         "processes of the torchrun launch (default: 1)")
    certify.add_argument("--data-parallel", type=int, help="data_parallel of the default sweep: 1 or the number of "
                         "processes of the torchrun launch (default: 1)")
    certify.add_argument("--threads", type=int, help="PyTorch CPU threads of the default sweep's configurations "
                                                     "(default: the process's; its threads-1 variant keeps 1)")
    _progress_flag(certify)
    certify.set_defaults(run=_cmd_certify)

    verify = sub.add_parser("verify", help="check a certificate's hash, signature and stored runs; name its signer")
    verify.add_argument("certificate", help="certificate.json or crosscheck.json (or the folder holding it)")
    verify.add_argument("--public-key", help="require a signature by this Ed25519 public key (PEM)")
    verify.add_argument("--rerun", action="store_true", help="also re-execute the reference configuration and "
                                                              "compare roots")
    verify.add_argument("--model", help="checkpoint folder for --rerun (default: the one the certificate records, "
                                        "looked for relative to the certificate's folder, then at its recorded path)")
    verify.add_argument("--suite", help="suite for --rerun, KIND:PATH or a path (default: the one the certificate "
                                        "records, looked for like --model's); it must hash as the certified one")
    _progress_flag(verify)
    verify.set_defaults(run=_cmd_verify)

    keygen = sub.add_parser("keygen", help="make an Ed25519 key pair for signing certificates")
    keygen.add_argument("--out", required=True, help="writes OUT.key (private, mode 600) and OUT.pub")
    keygen.set_defaults(run=_cmd_keygen)

    compare = sub.add_parser("compare", help="compare runs request by request with the first one")
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or certificates: their reference run)")
    _near_tie_flag(compare)
    compare.add_argument("--json", action="store_true", help="print the per-request comparison as JSON lines")
    compare.set_defaults(run=_cmd_compare)

    diff = sub.add_parser("diff", help="regression check: exit 0 if streams are identical, 1 if any diverged, "
                                       "2 on bad input")
    diff.add_argument("--baseline", required=True, help="run folder or certificate")
    diff.add_argument("--run", required=True, dest="candidate", help="run folder or certificate")
    _near_tie_flag(diff)
    diff.set_defaults(run=_cmd_diff)

    certify_runs = sub.add_parser("certify-runs", help="certify runs recorded already (e.g. another engine's, "
                                                        "imported) against the first",
                                  description="Copy the runs into --out and certify them as certify does: the first "
                                              "is the reference, every other a variant; writes certificate.json, "
                                              "report.md and report.html.")
    certify_runs.add_argument("runs", nargs="+", metavar="[NAME=]RUN", help="run folders, the reference first")
    certify_runs.add_argument("--out", required=True, help="output folder (must be new or empty)")
    certify_runs.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the certificate with")
    _near_tie_flag(certify_runs)
    certify_runs.set_defaults(run=_cmd_certify_runs)

    metrics = sub.add_parser("metric-diff", help="lm-eval metrics of two runs sample by sample: unchanged, numbers "
                                                 "changed, or quality changed (exit 1)",
                             description="Pair two lm-eval runs' per-sample metrics by task and document and, per "
                                         "metric, bootstrap the mean paired difference: 'numbers changed' when its "
                                         "confidence interval holds 0, 'quality changed' (exit 1) when it does not.")
    for side, what in (("baseline", "the older run"), ("candidate", "the newer run")):
        metrics.add_argument(side, help=f"{what}: `audit eval`'s --out folder (or one OUT/lm_eval/batch-N.json), or "
                                        "`deepinfer lm-eval --log_samples`'s output folder or results_<date>.json")
    metrics.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default: 10000)")
    metrics.add_argument("--confidence", type=float, default=0.95, help="interval's confidence (default: 0.95)")
    metrics.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default: 0)")
    metrics.set_defaults(run=_cmd_metric_diff)

    crosscheck = sub.add_parser("crosscheck", help="classify runs of one suite from other devices, CPU code paths "
                                                   "or releases request by request against the first, and seal it",
                                description="Copy the runs into --out, classify each request of each run against the "
                                            "first (bitwise, logprob drift, diverged at a near-tie, diverged, "
                                            "missing, error) and write crosscheck.json, report.md and report.html.")
    crosscheck.add_argument("runs", nargs="+", metavar="[NAME=]RUN",
                            help="run folders (or certificates: their reference run), the first the reference; "
                                 "NAME defaults to the folder's name")
    crosscheck.add_argument("--out", required=True, help="output folder (must be new or empty)")
    crosscheck.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the crosscheck with")
    crosscheck.add_argument("--expect", choices=("bitwise", "tokens"),
                            help="exit 1 unless every request is bitwise equal (bitwise) or has the same tokens "
                                 "(tokens) in every pair")
    _near_tie_flag(crosscheck)
    crosscheck.set_defaults(run=_cmd_crosscheck)

    add_eval_command(sub)
    add_replay_commands(sub)
    add_bisect_commands(sub)
    add_import_command(sub)

    report = sub.add_parser("report", help="write report.md and report.html for a certification or crosscheck "
                                          "folder (refused unless it verifies)")
    report.add_argument("folder", help="the --out folder of `deepinfer audit certify` or `audit crosscheck`")
    report.set_defaults(run=_cmd_report)


def _model_and_suite(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--suite", required=True,
                        help="KIND:PATH, a JSONL file of requests, or a shipped suite name (smoke)")
    parser.add_argument("--run-seed", type=int, default=0, help="seed from which unseeded requests derive theirs")


def _variant_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="run", help="configuration name recorded in the manifest")
    add_engine_flags(parser, skip=("seed",))  # --run-seed comes with the suite
    parser.add_argument("--shuffle", action="store_true", help="submit requests in a seeded random order")
    parser.add_argument("--stagger", type=int, default=0, help="admit one request every K engine steps")
    parser.add_argument("--threads", type=int, default=None, help="PyTorch CPU threads for the run")
    parser.add_argument("--shards", type=int, default=1, help="split the suite round robin over N engines "
                        "over the same weights, into one run (the same root for any N)")
    _progress_flag(parser)


def _progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _near_tie_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--near-tie", type=float, default=1e-2,
                        help="a divergence whose top-2 logprob margin is below this is a near-tie (default: 0.01)")


def _cmd_run(args: argparse.Namespace) -> int:
    from deepinfer.audit.certificate import describe_errors, error_counts
    from deepinfer.audit.store import read_run
    from deepinfer.harness.record import record_run
    from deepinfer.harness.suite_registry import load_suite
    from deepinfer.harness.sweep import Variant, check_variant

    try:
        engine = config_from_flags(args)
    except DeepInferError as err:
        raise DeepInferError(f"flags: {err}") from None
    variant = check_variant(Variant(args.name, engine, shuffle=args.shuffle, stagger=args.stagger,
                                    threads=args.threads, shards=args.shards), "flags")
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # before the model loads; the run store says the same
        raise DeepInferError(f"{out}: cannot create a run: it exists and is not a folder")
    if args.resume:
        from deepinfer.audit.store import MANIFEST
        _say_if_nothing_to_resume(out, MANIFEST, "run")
    root = record_run(args.model, load_suite(args.suite), variant, out, run_seed=args.run_seed,
                      resume=args.resume, progress=args.progress)
    if process_rank() != 0:  # another rank of a torchrun launch: rank 0 reports
        return 0
    errors = error_counts(read_run(out).streams)
    errored = f", {sum(errors.values())} errored ({describe_errors(errors)})" if errors else ""
    print(f"run {args.out}: {root['count']} requests{errored}, logit root {root['logit_root']}")
    return 0


def _say_if_nothing_to_resume(out: Path, marker: str, what: str) -> None:
    """A note on stderr when --resume finds no `marker` file in `out` (a mistyped folder, say): a new
    `what` starts there instead, which is said rather than done silently."""
    if process_rank() == 0 and not (out / marker).is_file():
        print(f"note: {out}: no {what} to resume there (no {marker}); starting a new {what}", file=sys.stderr)


def _cmd_certify(args: argparse.Namespace) -> int:
    """Exit 0 when the verdict is reproducible and every request was served; 1 when it is DIVERGENT or
    NO_REQUESTS_SERVED, or (without --allow-errors) when any request errored; the certificate and report
    are written either way."""
    from deepinfer.audit.certificate import CERTIFICATE, DIVERGENT, NOTHING_SERVED, verdict_summary
    from deepinfer.harness.certify import certify
    from deepinfer.reports import render_report

    sweep = _certify_sweep(args)
    out = Path(args.out)
    if args.resume:
        from deepinfer.harness.certify import SWEEP_FILE
        _say_if_nothing_to_resume(out, SWEEP_FILE, "certification")
    cert = certify(args.model, args.suite, sweep, out, run_seed=args.run_seed, resume=args.resume,
                   sign_key=Path(args.sign_key) if args.sign_key else None, progress=args.progress)
    if cert is None:  # another rank of a torchrun launch: rank 0 reports
        return 0
    report_md, report_html = render_report(out)
    print(f"verdict: {verdict_summary(cert)}")
    for control in cert.get("controls", []):
        print(f"control {control['name']}: {control['verdict']} ({_control_counts(control)})")
    print(f"certificate: {out / CERTIFICATE}")
    print(f"report: {report_md} and {report_html}")
    counts = cert["verdict_counts"]
    errored = counts["errored"] + counts["requests_errored_differently"]
    if errored and not args.allow_errors:
        print(f"FAIL: requests errored ({counts['errored']} of {counts['requests']} in the reference, "
              f"{counts['requests_errored_differently']} differently in a variant); the verdict covers only the "
              "served ones (--allow-errors accepts that)", file=sys.stderr)
    failed = cert["verdict"] in (DIVERGENT, NOTHING_SERVED) or (errored and not args.allow_errors)
    return EXIT_DIFFERENT if failed else 0


def _certify_sweep(args: argparse.Namespace):
    """The --sweep file, or the default sweep with --dtype, --device, --threads, --expert-parallel and
    --data-parallel (checked here, before any work); those flags set only the default sweep."""
    from dataclasses import replace

    from deepinfer.harness.sweep import Sweep, check_variant, checkpoint_drafter, default_sweep, load_sweep

    given = [flag for flag in ("dtype", "device", "threads", "expert_parallel", "data_parallel")
             if getattr(args, flag) is not None]
    if args.sweep:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise DeepInferError(f"{flag} sets the default sweep only: with --sweep, give {given[0]} in the "
                                 "sweep file's configurations")
        return load_sweep(args.sweep)
    drafter = checkpoint_drafter(args.model)
    try:
        sweep = default_sweep(args.dtype, args.device, drafter, args.expert_parallel, args.data_parallel)
    except DeepInferError as err:
        raise DeepInferError(f"flags: {err}") from None
    if args.threads is not None:
        def threaded(variant):
            return variant if variant.threads is not None else replace(variant, threads=args.threads)

        sweep = Sweep(threaded(sweep.reference), tuple(map(threaded, sweep.variants)),
                      tuple(map(threaded, sweep.controls)))
    for _, variant in sweep.configurations():
        check_variant(variant, "flags")
    return sweep


def _control_counts(control: dict) -> str:
    counts = control.get("comparison", {})
    return ", ".join(f"{k} {v}" for k, v in counts.items() if isinstance(v, int))


def _cmd_verify(args: argparse.Namespace) -> int:
    """Exit 1 on any problem; when intact, also say who signed it, since a valid signature by an unknown
    key (anyone can re-sign) proves nothing until the key is pinned with --public-key."""
    from deepinfer.audit.certificate import CERTIFICATE, load_certificate, verify_certificate
    from deepinfer.audit.crosscheck import is_crosscheck, load_crosscheck, verify_crosscheck
    from deepinfer.harness.certify import rerun_reference

    overrides = [flag for flag in ("model", "suite") if getattr(args, flag) is not None]
    if overrides and not args.rerun:
        raise DeepInferError(f"--{overrides[0]} only applies with --rerun")
    public_key = _read(args.public_key) if args.public_key else None
    if is_crosscheck(args.certificate):
        if args.rerun:
            raise DeepInferError("--rerun re-executes a certificate's reference configuration: a crosscheck's runs "
                                 "were made elsewhere")
        return _verdict_of(args.certificate, verify_crosscheck(args.certificate, public_key), public_key,
                           load_crosscheck, rerun=False)
    file = Path(args.certificate) / CERTIFICATE if Path(args.certificate).is_dir() else Path(args.certificate)
    if not file.exists() and not file.is_symlink():  # nothing to verify: a wrong path, not a failed check
        raise DeepInferError(f"{file}: cannot read (No such file or directory)")
    problems = verify_certificate(Path(args.certificate), public_key)
    if not problems and args.rerun:
        problems = rerun_reference(Path(args.certificate), args.model, args.suite, progress=args.progress)
    return _verdict_of(args.certificate, problems, public_key, load_certificate, rerun=args.rerun)


def _verdict_of(path: str, problems: list[str], public_key: bytes | None, load, *, rerun: bool) -> int:
    from deepinfer.audit.certificate import signer_statement

    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    if problems:
        return EXIT_DIFFERENT
    print(f"OK: {path} is intact" + (" and its reference run reproduces bit for bit" if rerun else ""))
    print(signer_statement(load(path), pinned=public_key is not None))
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from deepinfer.audit.certificate import generate_keypair

    private, public = generate_keypair()
    key_path, pub_path = Path(args.out + ".key"), Path(args.out + ".pub")
    for path in (key_path, pub_path):
        if path.exists():
            raise DeepInferError(f"{path} exists: refusing to overwrite a key")
    try:
        with open(key_path, "xb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(private)
        pub_path.write_bytes(public)
    except OSError as err:
        raise DeepInferError(f"{args.out}: cannot write the key pair ({err.strerror or err})") from None
    print(f"private key: {key_path}\npublic key: {pub_path}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from deepinfer.audit.certificate import reference_run
    from deepinfer.audit.compare import compare_streams, format_comparison

    if len(args.runs) < 2:
        raise DeepInferError("compare needs at least two runs")
    base = reference_run(Path(args.runs[0]))
    for other_path in args.runs[1:]:
        other = reference_run(Path(other_path))
        comparison = compare_streams(base.streams, other.streams, args.near_tie)
        if args.json:
            for row in comparison.iter_rows(named=True):
                print(json.dumps({"baseline": args.runs[0], "run": other_path, **row}))
        else:
            print(format_comparison(comparison, args.runs[0], other_path))
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from deepinfer.audit.certificate import reference_run
    from deepinfer.audit.compare import compare_streams, format_comparison

    baseline, candidate = reference_run(Path(args.baseline)), reference_run(Path(args.candidate))
    comparison = compare_streams(baseline.streams, candidate.streams, args.near_tie)
    print(format_comparison(comparison, args.baseline, args.candidate))
    identical = comparison["status"].eq("equal").all() and candidate.streams.height == baseline.streams.height
    return 0 if identical else EXIT_DIFFERENT


def _cmd_crosscheck(args: argparse.Namespace) -> int:
    """Exit 0 once written, unless --expect names a class some request falls short of (exit 1). The runs
    are gathered in a hidden folder beside --out and renamed into place whole: a failure leaves nothing."""
    from deepinfer.audit.certificate import gather_runs, sign
    from deepinfer.audit.crosscheck import build_crosscheck, format_pair, write_crosscheck
    from deepinfer.reports import render_report

    given, out = _named_runs(args.runs), _new_folder(args.out, "a crosscheck")
    with _building(out) as building:
        crosscheck = build_crosscheck(building, gather_runs(building, given), args.near_tie)
        if args.sign_key:
            crosscheck = sign(crosscheck, _read(args.sign_key))
        file = write_crosscheck(building, crosscheck)
    report_md, report_html = render_report(out)
    for pair in crosscheck["pairs"]:
        print(format_pair(pair))
    print(f"crosscheck: {out / file.name}")
    print(f"report: {report_md} and {report_html}")
    allowed = {"bitwise": ("bitwise",), "tokens": ("bitwise", "logprob_drift")}.get(args.expect)
    short = allowed is not None and any(sum(pair["classes"][c] for c in allowed) != pair["requests"]
                                        for pair in crosscheck["pairs"])
    return EXIT_DIFFERENT if short else 0


def _cmd_metric_diff(args: argparse.Namespace) -> int:
    """Exit 1 when some metric's quality changed; metrics lm-eval aggregates over the corpus are named,
    not compared."""
    from deepinfer.audit.metric_deltas import (QUALITY_CHANGED, format_metric_deltas, metric_deltas, metric_samples,
                                               per_sample)

    baseline, skipped = per_sample(metric_samples(args.baseline))
    candidate, _ = per_sample(metric_samples(args.candidate))
    rows = metric_deltas(baseline, candidate, resamples=args.resamples, confidence=args.confidence, seed=args.seed)
    print(format_metric_deltas(rows))
    if skipped:
        print(f"not compared (not one number per sample): {', '.join(skipped)}")
    return EXIT_DIFFERENT if any(row.verdict == QUALITY_CHANGED for row in rows) else 0


def _cmd_certify_runs(args: argparse.Namespace) -> int:
    """Exit 0 when the verdict is reproducible and every request was served, 1 otherwise (as certify)."""
    from deepinfer.audit.certificate import CERTIFICATE, DIVERGENT, NOTHING_SERVED, verdict_summary
    from deepinfer.harness.certify import certify_runs
    from deepinfer.reports import render_report

    given, out = _named_runs(args.runs), _new_folder(args.out, "a certificate")
    with _building(out) as building:
        cert = certify_runs(given, building, sign_key=Path(args.sign_key) if args.sign_key else None,
                            near_tie_threshold=args.near_tie)
    report_md, report_html = render_report(out)
    print(f"verdict: {verdict_summary(cert)}")
    print(f"certificate: {out / CERTIFICATE}")
    print(f"report: {report_md} and {report_html}")
    counts = cert["verdict_counts"]
    failed = cert["verdict"] in (DIVERGENT, NOTHING_SERVED) or counts["errored"] + counts["requests_errored_differently"]
    return EXIT_DIFFERENT if failed else 0


def _named_runs(specs: list[str]) -> list[tuple[str, Path]]:
    """[NAME=]RUN arguments as (name, run folder): a certificate names its reference run; NAME defaults to
    the folder's name."""
    from deepinfer.audit.certificate import reference_run

    given = []
    for spec in specs:
        name, _, path = spec.rpartition("=")
        run = reference_run(Path(path))
        given.append((name or run.path.name, run.path))
    return given


def _new_folder(path: str, what: str) -> Path:
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DeepInferError(f"{out}: exists and is not an empty folder; {what} is written into a new one")
    return out


@contextlib.contextmanager
def _building(out: Path):
    """A hidden folder beside `out`, renamed into place when the block ends; removed on failure, so a
    refusal or an interruption leaves nothing."""
    building = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        yield building
        building.replace(out)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _cmd_report(args: argparse.Namespace) -> int:
    from deepinfer.reports import render_report

    md, html = render_report(Path(args.folder))
    print(f"report: {md} and {html}")
    return 0


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise DeepInferError(f"{path}: cannot read ({err.strerror or err})") from None


if __name__ == "__main__":
    sys.exit(main())
