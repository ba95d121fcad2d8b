"""reports.render_report on a synthetic certify folder: both files written, HTML self-contained and
parseable, verdicts and divergences shown; broken runs rejected with an AuditError naming the run."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest

from deepinfer.audit.certificate import build_certificate, control_verdicts, seal, verdict, write_certificate
from deepinfer.audit.errors import AuditError
from deepinfer.audit.store import RunStore, make_row
from deepinfer.reports import render_report
from deepinfer.reports.groups import request_grouping
from deepinfer.reports.html import html_table

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
REQUEST_IDS = ["greet", "sum", "poem", "code"]
TOKENS = [10, 11, 12, 13]
LOGPROBS = [-0.5, -0.25, -1.0, -0.125]  # fp32-exact
ALT = 0.75  # top-2 logprob = top-1 - ALT: a wide margin (hard divergence)

DRIFTED = [-0.5, -0.25 - 2**-16, -1.0, -0.125]  # same tokens, one logprob off by 2^-16
NEAR_TIE_TOP = [[lp, lp - 2**-8] for lp in LOGPROBS]  # margin 0.0039 < 1e-2 everywhere

# (name, role, config, {request index: (tokens, logprobs, top-2 logprobs or None)} overriding the reference's)
CONFIGURATIONS = [
    ("reference", "reference", {"batch_size": 1, "numerics": "invariant"}, {}),
    ("batch-8", "variant", {"batch_size": 8, "numerics": "invariant"}, {}),
    ("chunked-prefill", "variant", {"batch_size": 8, "chunk": 2, "numerics": "invariant"},
     {1: ([10, 11, 99, 13], LOGPROBS, None), 2: (TOKENS, DRIFTED, None)}),
    ("fast", "control", {"batch_size": 8, "numerics": "fast"},
     {0: ([10, 77, 12, 13], LOGPROBS, NEAR_TIE_TOP), 3: ([10, 11, 12, 55], LOGPROBS, None)}),
]


def _rows(overrides: dict, request_ids: list[str], structured: dict | None = None) -> list[dict]:
    """`structured`: {request index: (constraint, text, finish reason)} for structured requests."""
    rows = []
    for i, (request_id, prompt) in enumerate(zip(request_ids, PROMPTS)):
        tokens, logprobs, top = overrides.get(i, (TOKENS, LOGPROBS, None))
        top = top or [[lp, lp - ALT] for lp in logprobs]
        constraint, text, finish = (structured or {}).get(i, (None, None, "length"))
        rows.append(
            make_row(
                index=i, request_id=request_id, prompt_token_ids=prompt,
                params={"max_tokens": 4, "seed": i, "temperature": 0.0,
                        **({"structured": constraint} if constraint else {})},
                token_ids=tokens, logprobs=logprobs,
                top_token_ids=[[t, t + 1] for t in tokens], top_logprobs=top,
                text=text, finish_reason=finish, error=None,
                arrival_s=0.0, first_token_s=0.1 * (i + 1), finish_s=0.5 * (i + 1),
            )
        )
    return rows


CAPPED = "oneDNN capped at AVX512_CORE_BF16 (AMX available, not used; bf16 matmuls: brg_matmul:avx512_core_bf16)"


def _torch_cpu(summary: str = CAPPED, **variables) -> dict:
    return {"capability": "AVX512", "threads": 2, "mkl_cbwr": None, "mkl_enable_instructions": None,
            "onednn_max_cpu_isa": "AVX512_CORE_BF16", "onednn": {"amx_used": False, "summary": summary}, **variables}


def _manifest(name: str, config: dict, torch_cpu: dict | None = None) -> dict:
    return {
        "format": "deepinfer-manifest/1",
        "engine_version": "0.1.0",
        "git": {"commit": "0" * 40, "dirty": False},
        "environment": {"python": "3.11.7", "platform": "Linux-x86_64", "cpu": "Test CPU <fast> & co",
                        "torch": "2.9.0", "triton": None, "cuda": None,
                        "gpu": ["NVIDIA H200"] if name == "fast" else [], "torch_cpu": torch_cpu or _torch_cpu()},
        "engine": config,
        "checkpoint": {"name": "tiny", "sha256": "ab" * 32},
        "suite": {"name": "synthetic", "requests": len(REQUEST_IDS)},
        "seeds": {"base": 0},
        "variant": config,
        "created": "2025-01-01T00:00:00Z",
    }


def _certify_folder(out: Path, configurations: list[tuple], request_ids: list[str] = REQUEST_IDS,
                    torch_cpu: dict[str, dict] | None = None, structured: dict[str, dict] | None = None,
                    stats: dict[str, dict] | None = None) -> Path:
    entries = []
    for name, role, config, overrides in configurations:
        config = {"name": name, **config, "dtype": "float32"}
        store = RunStore.create(out / "runs" / name, _manifest(name, config, (torch_cpu or {}).get(name)))
        rows = _rows(overrides, request_ids, (structured or {}).get(name))
        store.append(rows[:2])
        store.append(rows[2:])
        store.finalize()
        if name in (stats or {}):
            (out / "runs" / name / "stats.json").write_text(json.dumps(stats[name]))
        entries.append({"name": name, "role": role, "config": config, "run": f"runs/{name}"})
    cert = build_certificate(
        out_dir=out, reference=configurations[0][0], configurations=entries,
        suite={"name": "synthetic", "requests": len(REQUEST_IDS)}, checkpoint={"name": "tiny", "sha256": "ab" * 32},
        rerun={"suite": "synthetic", "run_seed": 0}, created="2025-01-01T00:00:00+00:00",
    )
    write_certificate(out / "certificate.json", seal(cert))
    return out


@pytest.fixture(scope="module")
def certified(tmp_path_factory) -> Path:
    return _certify_folder(tmp_path_factory.mktemp("certify"), CONFIGURATIONS)


@pytest.fixture(scope="module")
def rendered(certified) -> tuple[str, str]:
    md_path, html_path = render_report(certified)
    assert md_path == certified / "report.md" and html_path == certified / "report.html"
    return md_path.read_text(encoding="utf-8"), html_path.read_text(encoding="utf-8")


class _StrictParser(HTMLParser):
    """Records tag nesting problems and every URL-bearing attribute."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.urls: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v is not None]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_both_reports_written_with_figures(certified, rendered):
    md, _ = rendered
    pngs = sorted(p.name for p in (certified / "report_files").glob("*.png"))
    assert pngs == ["divergence_positions.png", "invariance.png", "logprob_drift.png"]
    for name in pngs:
        assert f"(report_files/{name})" in md
        assert (certified / "report_files" / name).read_bytes().startswith(b"\x89PNG")


def test_html_is_self_contained_and_well_formed(rendered):
    _, html = rendered
    for forbidden in ("http://", "https://", "<script", "<link ", "@import", "url("):
        assert forbidden not in html
    parser = _StrictParser()
    parser.feed(html)
    parser.close()
    assert parser.problems == [] and parser.stack == []
    assert parser.tags.count("img") == 3
    assert parser.urls and all(u.startswith("data:image/png;base64,") for u in parser.urls)
    assert "Test CPU &lt;fast&gt; &amp; co" in html  # manifest text is escaped


def test_reports_name_configurations_and_verdicts(rendered):
    for text in rendered:
        assert "do not match its runs" not in text
        for name, *_ in CONFIGURATIONS:
            assert name in text
        assert "Verdict: " in text and "DIVERGENT" in text
        flat = re.sub(r"<[^>]+>|\*\*", "", text)  # tags and bold markers out
        assert "fast control: DIVERGENT, 2/4 requests diverged (1 near-tie)" in flat
        assert "chunked-prefill (variant): 1/4 requests diverged, 1/4 with logprob drift only" in flat
        assert "batch-8 (variant): all 4 requests bitwise equal" in flat


def test_tables_show_counts_throughput_and_divergences(rendered):
    md, html = rendered
    lines = md.splitlines()
    chunked = next(line for line in lines if line.startswith("| chunked-prefill ") and "variant" in line)
    cells = [c.strip() for c in chunked.strip("|").split("|")]
    # the knobs that differ in one cell; two roots; equal, drift, diverged, near-tie, missing/error, errored,
    # tokens, tok/s, first token (median of 0.1, 0.2, 0.3, 0.4 s after arrival)
    assert cells[:3] == ["chunked-prefill", "variant", "batch_size=8, numerics=invariant, chunk=2"]
    assert cells[5:] == ["2", "1", "1", "0", "0", "0", "16", "8.0", "0.250"]
    long = "max_num_seqs=1, shuffle=True, stagger=0.05, max_num_batched_tokens=32"  # the default sweep's kind
    assert html_table(pl.DataFrame({"settings": [long], "root": ["0f1e2d3c4b5a"]})) == (
        '<div class="scroll"><table><thead><tr><th>settings</th><th>root</th></tr></thead><tbody><tr>'
        f'<td class="wrap">{long}</td><td>0f1e2d3c4b5a</td></tr></tbody></table></div>')  # a long cell wraps
    divergence_rows = [line for line in lines if line.startswith("| chunked-prefill ") and "hard" in line]
    assert len(divergence_rows) == 1
    cells = [c.strip() for c in divergence_rows[0].strip("|").split("|")]
    assert cells[:4] == ["chunked-prefill", "sum", "2", "12 → 99"]
    near = next(line for line in lines if line.startswith("| fast ") and "near-tie" in line)
    assert "| greet " in near and "| 1 " in near
    assert "<td>sum</td><td>2</td><td>12 → 99</td>" in html
    assert "Settings shared by every configuration: dtype=float32." in md
    assert "| dtype" not in md and "| name" not in md
    assert "- fast: gpu\n" in md  # the control ran on other hardware than the reference
    assert f"CPU: {CAPPED} (every configuration)." in md


def test_cpu_instruction_sets_are_listed_per_configuration_when_they_differ(tmp_path):
    amx = "oneDNN uses AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX; bf16 matmuls: brg_matmul:avx10_1_512_amx)"
    out = _certify_folder(tmp_path, CONFIGURATIONS[:3], torch_cpu={
        "batch-8": _torch_cpu(mkl_cbwr="AVX2,STRICT"), "chunked-prefill": _torch_cpu(amx)})
    md = render_report(out)[0].read_text(encoding="utf-8")
    assert ("The CPU instruction sets differ between configurations:\n\n"
            f"- reference: CPU: {CAPPED}\n- batch-8: CPU: {CAPPED}; MKL_CBWR=AVX2,STRICT\n"
            f"- chunked-prefill: CPU: {amx}\n") in md


def test_ungrouped_ids_get_no_group_section(rendered):
    for text in rendered:
        assert "Per-episode results" not in text and "Per-task results" not in text


TRACE_IDS = ["ep-a/turn-1", "ep-a/turn-2", "ep-b/turn-1", "ep-b/turn-2"]
TRACE_CONFIGURATIONS = [
    CONFIGURATIONS[0],
    CONFIGURATIONS[1],
    ("chunked-prefill", "variant", {"batch_size": 8, "chunk": 2, "numerics": "invariant"},
     {2: (TOKENS, [-0.5, -0.25, -1.0 - 2**-16, -0.125], None), 3: ([10, 11, 99, 13], LOGPROBS, None)}),
    ("fast", "control", {"batch_size": 8, "numerics": "fast"}, {1: (TOKENS, DRIFTED, None)}),
]


def _table_rows(md: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith(f"| {first_cell} ")]


def test_trace_episodes_get_a_per_episode_section(tmp_path):
    md_path, html_path = render_report(_certify_folder(tmp_path, TRACE_CONFIGURATIONS, TRACE_IDS))
    md, html = md_path.read_text(encoding="utf-8"), html_path.read_text(encoding="utf-8")
    section = md.split("## Per-episode results", 1)[1].split("\n## ", 1)[0]
    assert "Per-task results" not in md
    assert "4 requests form 2 episodes." in section
    assert "0 of 2 episodes are identical in all 3 non-reference configuration(s); 1 in all 2 variant(s)." in section
    assert "- batch-8 (variant): all 2 episodes identical\n" in section
    assert "- chunked-prefill (variant): 1 of 2 episodes diverged, 1 identical\n" in section
    assert "- fast (control): 1 of 2 episodes with logprob drift only, 1 identical\n" in section
    # columns: configuration, episode, turns, outcome, diverged turns, drift-only turns; identical pairs left out
    assert _table_rows(section, "chunked-prefill") == [
        ["chunked-prefill", "ep-b", "2", "diverged at turn 2, token 2 (hard)", "1", "1"]]
    assert _table_rows(section, "fast") == [["fast", "ep-a", "2", "logprob drift only", "0", "1"]]
    assert _table_rows(section, "batch-8") == []
    assert "<h2>Per-episode results</h2>" in html
    assert "<td>chunked-prefill</td><td>ep-b</td><td>2</td><td>diverged at turn 2, token 2 (hard)</td>" in html


def test_lm_eval_tasks_get_a_per_task_section(tmp_path):
    ids = ["arc/0/loglikelihood/0", "arc/1/loglikelihood/0", "gsm/0/generate_until/0", "gsm/1/generate_until/0"]
    md_path, _ = render_report(_certify_folder(tmp_path, CONFIGURATIONS[:3], ids))
    section = md_path.read_text(encoding="utf-8").split("## Per-task results", 1)[1].split("\n## ", 1)[0]
    assert "4 requests form 2 tasks." in section
    assert _table_rows(section, "chunked-prefill") == [
        ["chunked-prefill", "arc", "2", "diverged at request 1/loglikelihood/0, token 2 (hard)", "1", "0"],
        ["chunked-prefill", "gsm", "2", "logprob drift only", "0", "1"]]


def test_request_grouping_episodes_tasks_and_none():
    episodes = request_grouping(["x/y/turn-1", "x/y/turn-10", "line-3"])
    assert (episodes.noun, episodes.group, episodes.label, episodes.ungrouped) == (
        "episode", {"x/y/turn-1": "x/y", "x/y/turn-10": "x/y"}, {"x/y/turn-1": "turn 1", "x/y/turn-10": "turn 10"}, 1)
    tasks = request_grouping(["arc/0/loglikelihood/0", "arc/0/loglikelihood/1", "gsm/3/generate_until/0"])
    assert (tasks.noun, tasks.title) == ("task", "Per-task results")
    assert tasks.group == {"arc/0/loglikelihood/0": "arc", "arc/0/loglikelihood/1": "arc",
                           "gsm/3/generate_until/0": "gsm"}
    assert tasks.label["gsm/3/generate_until/0"] == "request 3/generate_until/0"
    assert request_grouping(REQUEST_IDS) is None


def test_rendering_again_gives_the_same_bytes(certified, rendered):
    md_path, html_path = render_report(certified)
    assert (md_path.read_text(encoding="utf-8"), html_path.read_text(encoding="utf-8")) == rendered


def test_no_divergence_says_so(tmp_path):
    out = _certify_folder(tmp_path, CONFIGURATIONS[:2])
    md_path, html_path = render_report(out)
    md, html = md_path.read_text(encoding="utf-8"), html_path.read_text(encoding="utf-8")
    for text in (md, html):
        assert "BITWISE_REPRODUCIBLE" in text
        assert "No divergences" in text and "No logprob drift" in text
        assert "No request diverged, went missing or errored differently from the reference" in text
        assert "No request errored in any configuration" in text
        assert "over all " in text
        assert "Every configuration ran in this environment." in text
    assert sorted(p.name for p in (out / "report_files").glob("*.png")) == ["invariance.png"]


def _reseal(out: Path, cert: dict) -> None:
    """Rewrite a certificate that still verifies on its own (a report refuses one that does not), so
    that what the report checks against the runs is what is tested."""
    cert["verdict"], cert["verdict_counts"] = verdict(cert["configurations"])
    cert["controls"] = control_verdicts(cert["configurations"])
    write_certificate(out / "certificate.json", seal(cert))


@pytest.mark.parametrize(
    ("damage", "says"),
    [("missing streams", "streams.parquet"), ("corrupt root", "root.json"),
     ("root not certified", "root.json token_root does not match the certificate")],
)
def test_broken_run_is_an_audit_error_naming_it(tmp_path, damage, says):
    out = _certify_folder(tmp_path, CONFIGURATIONS[:2])
    run = out / "runs" / "batch-8"
    if damage == "missing streams":
        (run / "streams.parquet").unlink()
    elif damage == "corrupt root":
        (run / "root.json").write_text("{not json", encoding="utf-8")
    else:
        cert = json.loads((out / "certificate.json").read_text(encoding="utf-8"))
        cert["configurations"][1]["token_root"] = "0" * 64
        _reseal(out, cert)
    with pytest.raises(AuditError, match="configuration 'batch-8' \\(runs/batch-8\\): ") as raised:
        render_report(out)
    assert says in str(raised.value)
    assert not (out / "report.md").exists()


def test_missing_certificate_is_an_audit_error(tmp_path):
    with pytest.raises(AuditError, match="certificate.json"):
        render_report(tmp_path)


def test_certificate_counts_that_disagree_with_the_runs_are_flagged(tmp_path):
    out = _certify_folder(tmp_path, CONFIGURATIONS[:2])
    cert = json.loads((out / "certificate.json").read_text(encoding="utf-8"))
    cert["configurations"][1]["comparison"]["diverged"] = 3
    _reseal(out, cert)
    md_path, _ = render_report(out)
    md = md_path.read_text(encoding="utf-8")
    assert "do not match its runs" in md
    assert "- batch-8: diverged is 3 in the certificate, 0 in the runs" in md


def test_speculation_and_prefix_counters_come_from_each_runs_stats(tmp_path):
    """A speculating configuration shows its drafts from its stats.json (acceptance, kept per verify
    step, tokens per forward, rollbacks) and a prefix-cached one its hits; a missing or damaged
    stats.json shows dashes, never made-up numbers; configurations that did neither are left out."""
    configurations = [
        ("reference", "reference", {"batch_size": 1, "numerics": "invariant", "speculation": "off"}, {}),
        ("dspark", "variant", {"batch_size": 1, "numerics": "invariant", "speculation": "dspark",
                               "draft_tokens": 5}, {}),
        ("ngram", "variant", {"batch_size": 1, "numerics": "invariant", "speculation": "ngram",
                              "draft_tokens": 3}, {}),
    ]
    stats = {"sessions": 1, "wall_s": 1.0, "preemptions": 0, "drafted": 40, "drafts_kept": 30, "verify_chunks": 8,
             "rollbacks": 5, "rollback_rows": 10, "prefix_hit_tokens": 90, "prefix_query_tokens": 100,
             "verify_lengths": {"4": 5, "10": 2, "3": 1}}
    out = _certify_folder(tmp_path, configurations, stats={"dspark": stats, "ngram": stats})
    (out / "runs" / "ngram" / "stats.json").write_text("{not json")  # damaged after certification
    md = render_report(out)[0].read_text(encoding="utf-8")
    section = md.split("## Speculation and prefix cache", 1)[1].split("\n## ", 1)[0]
    assert _table_rows(section, "dspark") == [
        ["dspark", "dspark", "5", "40", "30", "75.0%", "3.75", "4.75", "3 drafts: 1, 4 drafts: 5, 10 drafts: 2", "5",
         "90 of 100 (90.0%)"]]
    assert _table_rows(section, "ngram") == [["ngram", "ngram", "3", "–", "–", "–", "–", "–", "–", "–", "–"]]
    assert _table_rows(section, "reference") == []
    assert "the certificate seals a speculating configuration's figures" in section


def test_structured_outputs_are_checked_per_configuration(tmp_path):
    """Each configuration's structured requests are checked against their constraints: a valid text,
    an invalid one, one cut by max_tokens, one under a grammar the checker cannot read (unchecked,
    left out of the validity rate)."""
    date, schema = {"regex": "[0-9]{4}-[0-9]{2}"}, {"json_schema": {"type": "object", "required": ["a"]}}
    tool_calls = {"grammar": 'start: <｜tool▁calls▁begin｜> "x" <｜tool▁calls▁end｜>', "syntax": "lark"}  # llguidance's Lark
    good = {0: (date, "2024-05", "stop"), 1: (schema, '{"a": 1}', "stop"), 3: (tool_calls, "x", "stop")}
    out = _certify_folder(tmp_path, CONFIGURATIONS[:2], structured={
        "reference": good, "batch-8": {**good, 1: (schema, '{"b": 1}', "stop"), 2: (date, "2024-0", "length")}})
    md = render_report(out)[0].read_text(encoding="utf-8")
    section = md.split("## Structured outputs", 1)[1].split("\n## ", 1)[0]
    assert _table_rows(section, "reference") == [["reference", "3", "2", "0", "0", "0", "1", "100.0%"]]
    assert _table_rows(section, "batch-8") == [["batch-8", "4", "1", "1", "1", "0", "1", "33.3%"]]
    assert "not sealed by the certificate" in section


def test_a_suite_without_constraints_has_no_structured_section(rendered):
    assert "## Structured outputs" not in rendered[0]


# --- layout at the page's width (issue 31, item 14) -----------------------------------------------------
# The report's page is at most 1400 px wide with 1.2rem padding each side. Cells are monospace at 0.8rem
# (12.8 px, about 0.6 em a character), headers proportional (about 0.55 em a character, and they wrap at
# spaces), each cell padded 0.4rem each side; a wrapping cell is at least 14 rem wide. The estimate below
# uses those figures; for the default sweep's table it gave 1256 px where headless Chromium's narrowest
# layout of the same report was 1268 px (and at 1400 px no table scrolled), hence the 3% margin.
PAGE_PX = 1400 - 2 * 1.2 * 16
CELL_CHAR_PX, HEADER_CHAR_PX, CELL_PAD_PX = 0.6 * 12.8, 0.55 * 12.8, 2 * 0.4 * 16 + 1
WRAP_MIN_PX = 14 * 16


def _table_width_px(frame: pl.DataFrame) -> float:
    """Estimated narrowest width of `html_table(frame)`: each column as wide as its widest one-line cell
    or header word, a wrapping cell at its minimum width."""
    from deepinfer.reports.html import WRAP_CHARS

    total = 0.0
    for column in frame.columns:
        header = max(len(word) for word in column.split()) * HEADER_CHAR_PX
        cells = [WRAP_MIN_PX if len(v) > WRAP_CHARS else len(v) * CELL_CHAR_PX for v in frame[column]]
        total += max(header, *cells) + CELL_PAD_PX
    return total


@pytest.fixture(scope="module")
def default_sweep_report(tmp_path_factory, monkeypatch_module):
    """A certification of the default sweep's 18 configurations (MTP drafter) whose every variant drifts
    or diverges somewhere, with the figures it draws kept as matplotlib figures."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    import deepinfer.reports.figures
    from deepinfer.harness.sweep import default_sweep

    sweep = default_sweep(drafter="mtp")
    configurations = []
    for k, (role, variant) in enumerate(sweep.configurations()):
        at = 1 + k % 3  # an even configuration diverges there, an odd one drifts
        diverged = (TOKENS[:at] + [99] + TOKENS[at + 1:], LOGPROBS, None)
        overrides = {} if role == "reference" else {k % 4: (TOKENS, DRIFTED, None) if k % 2 else diverged}
        configurations.append((variant.name, role, variant.to_dict(), overrides))
    out = _certify_folder(tmp_path_factory.mktemp("sweep"), configurations,
                          request_ids=[f"episode-{k}-with-a-long-agent-trace-name/turn-{k + 1}" for k in range(4)])
    figures = {}
    monkeypatch_module.setattr(deepinfer.reports.figures, "png_of", lambda fig: figures.setdefault(fig.axes[0].get_title(), fig)
                               and b"\x89PNG")
    render_report(out)
    for figure in figures.values():
        FigureCanvasAgg(figure).draw()  # the canvas `png_of` would have given it, laid out
    return out, figures


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_the_configurations_table_fits_the_page_for_the_default_sweep(default_sweep_report):
    from deepinfer.reports.load import load_audit
    from deepinfer.reports.tables import configurations_table

    frame = configurations_table(load_audit(default_sweep_report[0]))
    assert frame.height == 21  # the reference, 19 variants (harness.sweep.FACTORS, shards, threads-1, 4 drafters), the fast control
    assert 1.03 * _table_width_px(frame) <= PAGE_PX, _table_width_px(frame)


def test_legends_are_clear_of_the_data(default_sweep_report):
    figures = default_sweep_report[1]
    drift = figures["Logprob drift against the reference (requests with zero drift not drawn)"]
    spread = figures["Where streams first diverge"]
    for figure in (drift, spread):
        axes, legend = figure.axes[0], figure.axes[0].get_legend()
        assert len(legend.get_texts()) >= 8
        assert legend.get_window_extent().x0 >= axes.get_window_extent().x1  # right of the plot, not on it
    heatmap = figures["Invariance: each configuration against the reference"]
    axes, legend = heatmap.axes[0], heatmap.legends[0]
    renderer = heatmap.canvas.get_renderer()
    labels_bottom = min(label.get_window_extent(renderer).y0 for label in axes.get_xticklabels())
    gap = labels_bottom - legend.get_window_extent(renderer).y1
    assert 0 <= gap <= 30, gap  # just below the request labels: no overlap, no large gap
