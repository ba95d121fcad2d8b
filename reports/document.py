"""The report as a format-free document (headline, sections of blocks); Markdown and HTML renderers
lay the same document out, so both reports always say the same thing."""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from deepinfer.audit.certificate import signer_fingerprint, verdict_summary
from deepinfer.reports import figures, tables
from deepinfer.reports.groups import group_outcomes, request_grouping
from deepinfer.reports.load import AuditData

COUNTED = ("equal", "logprob_drift", "diverged", "near_tie", "missing", "error")
GROUP_KINDS = (("diverged", "diverged"), ("drift", "with logprob drift only"), ("identical", "identical"))
VERDICT_LEVELS = {"BITWISE_REPRODUCIBLE": "good", "TOKEN_REPRODUCIBLE": "warn", "DIVERGENT": "bad",
                  "NO_REQUESTS_SERVED": "bad"}


@dataclass(frozen=True)
class Verdict:
    """A verdict; level is good / warn / bad / unknown (drives the HTML colour); the primary one is
    shown large, controls' smaller with their detail on the same line."""

    label: str
    verdict: str
    level: str
    detail: str = ""
    primary: bool = False


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: list[str]


@dataclass(frozen=True)
class Note:
    """An explicit statement that a figure or table has nothing to show."""

    text: str


@dataclass(frozen=True)
class Table:
    frame: pl.DataFrame


@dataclass(frozen=True)
class Figure:
    """A PNG figure; `filename` is its name under report_files/ next to report.md."""

    filename: str
    png: bytes
    caption: str


Block = Verdict | Paragraph | Bullets | Note | Table | Figure


@dataclass(frozen=True)
class Section:
    title: str
    blocks: list[Block] = field(default_factory=list)


@dataclass(frozen=True)
class Document:
    title: str
    intro: list[Block]
    sections: list[Section]


def verdict_level(verdict: str) -> str:
    return VERDICT_LEVELS.get(verdict, "unknown")


def outcome(counts: dict) -> str:
    """Plain-language outcome of one configuration against the reference, from its summary counts."""
    n = counts["requests"]
    parts = []
    if counts["diverged"]:
        near = f" ({counts['near_tie']} near-tie)" if counts["near_tie"] else ""
        parts.append(f"{counts['diverged']}/{n} requests diverged{near}")
    if counts["logprob_drift"]:
        parts.append(f"{counts['logprob_drift']}/{n} with logprob drift only")
    if counts["missing"] + counts["error"]:
        parts.append(f"{counts['missing'] + counts['error']}/{n} missing or errored")
    return ", ".join(parts) if parts else f"all {n} requests bitwise equal"


def count_mismatches(data: AuditData) -> list[str]:
    """Where the certificate's comparison counts disagree with the runs compared afresh."""
    lines = []
    for entry in data.certificate["configurations"]:
        recorded = entry.get("comparison") or {}
        fresh = data.summary(entry["name"])
        for key in COUNTED:
            if key in recorded and recorded[key] != fresh[key]:
                lines.append(f"{entry['name']}: {key} is {recorded[key]} in the certificate, {fresh[key]} in the runs")
    return lines


def _headline(data: AuditData, counts: dict[str, dict]) -> Section:
    cert = data.certificate
    variants = [c for c in data.configurations if c.role == "variant"]
    controls = [c for c in data.configurations if c.role == "control"]
    control_verdicts = {c.get("name"): c.get("verdict", "–") for c in cert.get("controls") or []}
    blocks: list[Block] = [
        Verdict("Verdict", cert["verdict"], verdict_level(cert["verdict"]), primary=True),
        Paragraph(verdict_summary(cert) + "."),
        Paragraph(
            f"{len(variants)} variant configuration(s) compared with the reference {data.reference.name!r} "
            f"on {counts[data.reference.name]['requests']} requests; the verdict covers variants only."
        ),
        Bullets([f"{c.name} (variant): {outcome(counts[c.name])}" for c in variants] or ["no variants"]),
    ]
    mismatches = count_mismatches(data)
    if mismatches:
        blocks += [Note("The certificate's comparison counts do not match its runs; this report shows the runs."),
                   Bullets(mismatches)]
    if controls:
        blocks.append(
            Paragraph(
                "Controls are configurations expected to break the determinism contract (such as fast, "
                "non-batch-invariant numerics); they are reported but not part of the verdict. A diverging "
                "control shows the suite can expose nondeterminism; a control that stays equal means this suite "
                "did not exercise it."
            )
        )
        for c in controls:
            verdict = control_verdicts.get(c.name, "–")
            blocks.append(Verdict(f"{c.name} control", verdict, verdict_level(verdict), outcome(counts[c.name])))
    return Section("Verdict", blocks)


def _certificate_facts(data: AuditData) -> Paragraph:
    cert = data.certificate
    signer = signer_fingerprint(cert)
    signed = f"signed by key {signer} (not pinned: audit verify --public-key pins it)" if signer else "unsigned"
    return Paragraph(
        f"Certificate created {cert.get('created', '–')}, content hash {cert.get('content_hash', '–')}, {signed}. "
        f"{_checkpoint_facts(cert.get('checkpoint') or {})}"
    )


def _checkpoint_facts(checkpoint: dict) -> str:
    """The certified checkpoint: content hash, and the model family, stored formats and tokenizer where
    the run recorded them (runs made before they were recorded have only the hash)."""
    facts = f"Checkpoint {checkpoint.get('content_hash', '–')}"
    if "family" in checkpoint:
        facts += f", model family {checkpoint['family']}"
    if "formats" in checkpoint:
        facts += ", stored as " + "; ".join(f"{part} {fmt}" for part, fmt in checkpoint["formats"].items())
    facts += "."
    tokenizer = checkpoint.get("tokenizer")
    if isinstance(tokenizer, dict):
        facts += (f" Tokenizer: {tokenizer.get('provenance', '–')}, {tokenizer.get('vocab_size', '–')} ids, "
                  f"tokenizer.json sha256 {tokenizer.get('content_hash', '–')}.")
    elif "tokenizer" in checkpoint:
        facts += " No tokenizer (token-id prompts only)."
    return facts


def _environment_differences(data: AuditData) -> list[Block]:
    differences = tables.environment_differences(data)
    if not differences:
        return [Paragraph("Every configuration ran in this environment.")]
    return [Paragraph("Configurations whose environment differs from the reference's, and where:"),
            Bullets(differences)]


def cpu_isa_blocks(data: AuditData) -> list[Block]:
    """The CPU instruction sets each run's kernels could use (audit.certificate.cpu_isa_statement): once
    when every configuration agrees, else one line per configuration."""
    statements = {c.name: c.cpu_isa for c in data.configurations}
    if len(set(statements.values())) == 1:
        return [Paragraph(f"{next(iter(statements.values()))} (every configuration).")]
    return [Paragraph("The CPU instruction sets differ between configurations:"),
            Bullets([f"{name}: {statement}" for name, statement in statements.items()])]


def _figure_or_note(png: bytes | None, filename: str, caption: str, empty: str) -> Block:
    return Note(empty) if png is None else Figure(filename, png, caption)


def _groups_section(data: AuditData) -> list[Section]:
    """Per-episode (agent traces) or per-task (lm-eval) results; no section when no request id has a '/'."""
    grouping = request_grouping(data.comparisons.filter(pl.col("configuration") == data.reference.name)
                                ["request_id"].to_list())
    if grouping is None:
        return []
    noun, members = grouping.noun, f"{grouping.member}s"
    outcomes = group_outcomes(data, grouping)
    n_groups = len(set(grouping.group.values()))
    blocks: list[Block] = [
        Paragraph(
            f"{len(grouping.group)} requests form {n_groups} {noun}s. Per configuration, each {noun} is identical "
            f"when all its {members} are bitwise equal to the reference's, has logprob drift only when its token "
            f"ids all match but some logprobs differ, and otherwise is named with the first of its {members} to "
            f"diverge (in suite order), that request's first divergent generated-token position (counted from 0, "
            f"as under Diverged requests) and whether it was a near-tie. Diverged {members} counts missing and "
            "errored ones too."
        ),
    ]
    if grouping.ungrouped:
        blocks.append(Paragraph(f"{grouping.ungrouped} request(s) whose id has no '/' belong to no {noun} and "
                                "are left out here; the other sections include them."))
    others = [c for c in data.configurations if c.role != "reference"]
    everywhere = n_groups - outcomes.filter(pl.col("kind") != "identical")["group"].n_unique()
    identical = f"{everywhere} of {n_groups} {noun}s are identical in all {len(others)} non-reference configuration(s)"
    variants = [c.name for c in others if c.role == "variant"]
    if len(variants) < len(others):
        broken = outcomes.filter(pl.col("configuration").is_in(variants) & (pl.col("kind") != "identical"))
        identical += f"; {n_groups - broken['group'].n_unique()} in all {len(variants)} variant(s)"
    blocks.append(Paragraph(identical + "."))
    lines = []
    for c in others:
        kinds = outcomes.filter(pl.col("configuration") == c.name)["kind"].to_list()
        if kinds.count("identical") == n_groups:
            lines.append(f"{c.name} ({c.role}): all {n_groups} {noun}s identical")
            continue
        counts = [(kinds.count(k), text) for k, text in GROUP_KINDS if kinds.count(k)]
        parts = [f"{counts[0][0]} of {n_groups} {noun}s {counts[0][1]}", *(f"{n} {text}" for n, text in counts[1:])]
        lines.append(f"{c.name} ({c.role}): {', '.join(parts)}")
    if lines:
        blocks.append(Bullets(lines))
    table = tables.group_table(outcomes, grouping)
    blocks.append(Note(f"Every {noun} is identical in every configuration.") if table.is_empty() else Table(table))
    return [Section(grouping.title, blocks)]


def _engine_counters(data: AuditData) -> Section:
    table = tables.engine_counters_table(data)
    if table.is_empty():
        return Section("Speculation and prefix cache", [Note("No configuration speculated or cached prefixes.")])
    return Section("Speculation and prefix cache", [
        Table(table),
        Paragraph("From each run's stats.json, the engine's own account of its work (the roots cover outputs "
                  "only): the certificate seals a speculating configuration's figures, and verification checks "
                  "them against stats.json; the prefix counts are not sealed. A draft is kept when it equals the "
                  "token the target samples at its position; kept per verify is the mean accepted length of a step "
                  "that verified drafts, tokens per forward that plus the token the target adds, verify lengths "
                  "how many steps verified each number of drafts; prefix hits count prompt tokens whose cache rows "
                  "were reused instead of computed."),
    ])


def _structured(data: AuditData) -> list[Section]:
    table = tables.structured_table(data)
    if table.is_empty():
        return []
    return [Section("Structured outputs", [
        Table(table),
        Paragraph("Requests with a structured constraint (regex, JSON Schema, choice, Lark or EBNF grammar), "
                  "each output checked against its constraint after the run (JSON Schemas with `jsonschema`, "
                  "grammars re-parsed with `lark`): valid, invalid, cut (max_tokens or the context ran out "
                  "before the constraint could end), errored, or unchecked (a constraint the checker cannot read, "
                  "such as a tool-call grammar); validity is over all but the unchecked. The check is the "
                  "report's, not sealed by the certificate."),
    ])]


def build_document(data: AuditData) -> Document:
    """Assemble every section of the report from the loaded audit data."""
    counts = {c.name: data.summary(c.name) for c in data.configurations}
    reference = data.reference
    others = data.comparisons.filter(pl.col("configuration") != reference.name)
    zero_drift = others.filter(pl.col("max_logprob_drift") == 0).height
    divergences = tables.divergence_table(data)
    errored = tables.errored_table(data)
    cert = data.certificate
    sections = [
        _headline(data, counts),
        Section(
            "Configurations",
            [
                Table(tables.configurations_table(data)),
                Paragraph(f"Settings shared by every configuration: {tables.shared_settings(data) or 'none'}."),
                *cpu_isa_blocks(data),
                Paragraph(
                    "Roots are the first 12 hex digits of each run's Merkle roots; counts compare each run with "
                    "the reference run request by request; a divergence is a near-tie when the smaller top-2 "
                    f"logprob margin there is below {cert['near_tie_threshold']:g}; "
                    "tok/s = generated tokens / latest finish time; first token = median time from a "
                    "request's arrival to its first sampled token."
                ),
            ],
        ),
        _engine_counters(data),
        *_structured(data),
        Section(
            "Invariance map",
            [Figure("invariance.png", figures.invariance_heatmap(data),
                    "Each configuration against the reference, one cell per request.")],
        ),
        Section(
            "First divergence positions",
            [_figure_or_note(figures.divergence_histogram(data), "divergence_positions.png",
                             "First divergent generated-token position, all non-reference configurations.",
                             "No divergences: every configuration generated the reference's token ids.")],
        ),
        Section(
            "Logprob drift",
            [
                _figure_or_note(figures.drift_plot(data), "logprob_drift.png",
                                "Max |Δlogprob| per request on the common prefix of identical token ids.",
                                "No logprob drift: every common prefix has bit-identical logprobs."),
                Paragraph(f"{zero_drift} of {others.height} non-reference request comparisons have zero drift."),
            ],
        ),
        *_groups_section(data),
        Section(
            "Diverged requests",
            [Note("No request diverged, went missing or errored differently from the reference.")
             if divergences.is_empty() else Table(divergences)],
        ),
        Section(
            "Errored requests",
            [Paragraph("Requests the engine refused (an error row: its kind and detail are hashed, so an "
                       "error repeated identically is reproducible, but the request produced no output)."),
             Note("No request errored in any configuration.") if errored.is_empty() else Table(errored)],
        ),
        Section(
            f"Environment of the reference run ({reference.name})",
            [Table(tables.environment_table(reference)), *_environment_differences(data)],
        ),
        Section(
            "Inputs",
            [Table(tables.key_value_table({k: cert.get(k) for k in ("checkpoint", "suite", "rerun")}))],
        ),
    ]
    return Document("DeepInfer reproducibility report", [_certificate_facts(data)], sections)
