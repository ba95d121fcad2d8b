"""`EngineConfig`: every engine setting once, with its one default, validated once.

`LLM(model, config=EngineConfig(...))` builds an engine from it (keyword arguments to `LLM` build
one). The command lines generate their engine flags from its fields (`add_engine_flags`,
`config_from_flags`), the harness's sweep configurations hold one, and runs record
`asdict(llm.engine_config)`: the configuration as resolved (`max_model_len` filled in).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields

import torch

from deepinfer.engine.drafter import SPECULATION
from deepinfer.errors import DeepInferError
from deepinfer.sampling_params import UNSEEDED_SEEDS
from deepinfer.kernels import NUMERICS

MAX_DRAFT_TOKENS = 16  # each costs a verified position per sequence and step; past a few, most are rejected

WEIGHT_STORAGE = ("auto", "quantized", "decoded")
ENGRAM_TABLES = ("device", "host")
VERIFY_POLICY = ("fixed", "throughput")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _setting(default, help: str, **flag):
    """A field with its help text; `choices` for a string, and for a boolean on by default `off`, the
    help of its `--no-...` flag."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs a model (not which model: that is `LLM`'s first argument)."""

    device: str = _setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = _setting("float32", "float32 or bfloat16 (float16 too)", choices=tuple(DTYPES))
    numerics: str = _setting("batch_invariant", "batch_invariant (bitwise reproducible) or fast", choices=NUMERICS)
    max_num_seqs: int = _setting(32, "most sequences in one step")
    max_num_batched_tokens: int = _setting(512, "token budget of one step")
    max_model_len: int | None = _setting(None, "context length (default: the model's, capped to fit the memory)")
    num_cache_blocks: int | None = _setting(None, "cache blocks per pool (default: room for max_num_seqs "
                                                  "sequences of max_model_len)")
    block_size: int = _setting(16, "tokens per cache block")
    enable_chunked_prefill: bool = _setting(True, "split long prompts over steps", off=(
        "--no-chunked-prefill", "never split a prompt over steps (the step budget grows to max_model_len)"))
    prefix_caching: bool = _setting(True, "keep the cache rows of computed prompt and output blocks and start "
                                          "requests that begin with the same tokens after them; with "
                                          "batch_invariant numerics the outputs are the same bits either way "
                                          "(fast numerics promises no bits, with or without it); cached rows "
                                          "give way to running requests when blocks run short", off=(
        "--no-prefix-caching", "compute every request's prompt in full, keeping no rows after a request"))
    cache_qdq: bool = _setting(True, "V4.1: keep the caches in the release's formats (FP8 window KV, NVFP4 "
                                     "compressed KV, MXFP4 indexer queries and keys), as its reference does; "
                                     "V4 has none", off=(
        "--no-cache-qdq", "V4.1: keep the caches in full precision instead of the release's formats"))
    weight_storage: str = _setting("auto", "quantized checkpoints: keep FP8/MXFP4 weights as stored and decode them "
                                   "inside the matmuls (quantized), decode them once at load (decoded), or auto "
                                   "(quantized on CUDA, decoded on CPU); the outputs are the same bits either way",
                                   choices=WEIGHT_STORAGE)
    engram_tables: str = _setting("device", "V4.1: where the Engram tables live: on the device, or in host memory, "
                                  "where the runner reads each step's rows (Flash's are 183 GiB); the same rows "
                                  "either way", choices=ENGRAM_TABLES)
    cuda_graphs: bool = _setting(True, "CUDA: replay decode steps from CUDA graphs captured once per step shape "
                                       "(with batch_invariant numerics the same bits as running them eagerly); "
                                       "the CPU runs every step eagerly", off=(
        "--no-cuda-graphs", "CUDA: run every step eagerly instead of replaying decode steps from graphs"))
    async_scheduling: bool = _setting(True, "schedule and prepare each step while the device runs the one before, "
                                            "reading a step's tokens one step late (the same bits; a request that "
                                            "stops costs one discarded step); off with engram_tables=host, whose "
                                            "rows are gathered from the tokens of the step before", off=(
        "--no-async-scheduling", "read each step's results before scheduling the next"))
    speculation: str = _setting("off", "speculative decoding: off, ngram (draft the tokens that followed the "
                                "latest earlier occurrence of a sequence's last tokens), dspark (V4.1: the "
                                "checkpoint's DSpark draft layers draft a block per step) or mtp (V4: the "
                                "checkpoint's MTP block drafts draft_tokens tokens one after another); the model "
                                "verifies a sequence's drafts in one step and keeps each only where it equals the "
                                "token it samples there, so with batch_invariant numerics outputs are the same bits "
                                "either way; under async scheduling speculative steps are queued behind each other (the next step "
                                "takes their drafts on the device), except steps with a structured request",
                                choices=SPECULATION)
    draft_tokens: int = _setting(5, f"with speculation: most draft tokens one sequence verifies per step (1 to "
                                    f"{MAX_DRAFT_TOKENS}; dspark: at most its block size)")
    draft_confidence: float = _setting(0.0, "with speculation=dspark or mtp: verify a sequence's drafts only as far "
                                       "as the draft's confidence head gives all of them at least this chance to hold "
                                       "(0 to 1; 0: always draft_tokens)")
    verify_policy: str = _setting("fixed", "with speculation: draft every step and verify every draft the drafter "
                                  "proposes (fixed, synchronous scheduling), or per step only as many as are "
                                  "expected to pay against a plain step, from each sequence's own hold rates and the "
                                  "step times measured so far, running plain steps (no drafter, async scheduling) "
                                  "while none would (throughput: changes how many steps a run takes and its draft "
                                  "counts, never its outputs)", choices=VERIFY_POLICY)
    expert_parallel: int = _setting(1, "processes each MoE layer's routed experts are spread over: 1, or every "
                                    "process of a torchrun launch (tokens go to their experts' process and back, "
                                    "combined in the order one process uses: the same bits); steps run eagerly "
                                    "(no CUDA graphs)")
    expert_capacity: float | None = _setting(
        None, "with expert_parallel: each MoE layer sends each process a fixed number of rows, this many times "
        "its even share of the step's (token, expert) slots (the step's size agreed by every process first), so no "
        "layer reads sizes back to the host; a step whose slots overflow a capacity anywhere runs again with its own "
        "sizes on every process (the same bits; counted in stats as exchange_redos), and steps run synchronously; "
        "unset: every layer exchanges the step's own sizes, read on the host")
    data_parallel: int = _setting(1, "with several processes: 1 (every process runs every request, for "
                                  "expert_parallel) or every process (each runs its own share of a generate() "
                                  "batch, its attention and cache; the MoE layers exchange tokens across them); "
                                  "the same bits either way")
    context_parallel: int = _setting(1, "with several processes: split each step of at least 256 tokens (long "
                                     "prefill) over every process of the torchrun launch, balanced for causal "
                                     "attention, each attending for its own rows over caches every process holds "
                                     "in full (the same bits); with data_parallel=1 (expert_parallel may be the same)")
    seed: int = _setting(0, "seed from which unseeded requests derive theirs")
    unseeded_seeds: str = _setting("request_order", "how unseeded requests get a seed: request_order (the engine's "
                                   "request counter) or content (a hash of the request)", choices=UNSEEDED_SEEDS)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "draft_tokens", "expert_parallel",
                     "data_parallel", "context_parallel"):
            _check_positive(name, getattr(self, name))
        for name in ("max_model_len", "num_cache_blocks"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.seed is None or isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise DeepInferError(f"seed must be an integer, got {self.seed!r}")
        for name in ("enable_chunked_prefill", "prefix_caching", "cache_qdq", "cuda_graphs", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise DeepInferError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_choice("numerics", self.numerics, NUMERICS)
        _check_choice("unseeded_seeds", self.unseeded_seeds, UNSEEDED_SEEDS)
        _check_choice("weight_storage", self.weight_storage, WEIGHT_STORAGE)
        _check_choice("engram_tables", self.engram_tables, ENGRAM_TABLES)
        _check_choice("speculation", self.speculation, SPECULATION)
        _check_choice("verify_policy", self.verify_policy, VERIFY_POLICY)
        if self.verify_policy == "throughput" and max(self.expert_parallel, self.data_parallel,
                                                      self.context_parallel) > 1:
            raise DeepInferError("verify_policy=throughput decides from this process's own step times, which the "
                                 "other processes of a parallel layout do not share: use fixed with expert, data or "
                                 "context parallelism")
        if self.expert_capacity is not None:
            if isinstance(self.expert_capacity, bool) or not isinstance(self.expert_capacity, (int, float)) \
                    or not self.expert_capacity > 0:
                raise DeepInferError(f"expert_capacity must be a positive number, got {self.expert_capacity!r}")
            if self.expert_parallel == 1:
                raise DeepInferError("expert_capacity sizes the exchange of expert parallelism: set expert_parallel too")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise DeepInferError(f"draft_tokens must be from 1 to {MAX_DRAFT_TOKENS} (a step verifies at most that many "
                                 f"drafts per sequence), got {self.draft_tokens}")
        if isinstance(self.draft_confidence, bool) or not isinstance(self.draft_confidence, (int, float)) \
                or not 0 <= self.draft_confidence <= 1:
            raise DeepInferError(f"draft_confidence must be a number from 0 to 1, got {self.draft_confidence!r}")
        if isinstance(self.dtype, torch.dtype):  # accepted from Python callers, recorded by name
            names = [name for name, dtype in DTYPES.items() if dtype == self.dtype]
            if not names:
                raise DeepInferError(f"unknown dtype {self.dtype!r} (expected one of {', '.join(DTYPES)})")
            object.__setattr__(self, "dtype", names[0])
        _check_choice("dtype", self.dtype, tuple(DTYPES))
        parse_device(self.device)  # whether this machine has it is checked when an engine starts

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def keeps_weights_quantized(self) -> bool:
        """Whether quantized weights stay in their stored formats (`weight_storage`, auto resolved)."""
        if self.weight_storage == "auto":
            return parse_device(self.device).type == "cuda"
        return self.weight_storage == "quantized"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict, where: str = "engine configuration") -> "EngineConfig":
        """From a JSON object of fields (unknown names are refused, with the valid ones named)."""
        if not isinstance(values, dict):
            raise DeepInferError(f"{where}: expected an object of engine settings, got {type(values).__name__}")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise DeepInferError(f"{where}: unknown engine setting {unknown[0]!r} (expected one of "
                                 f"{', '.join(f.name for f in fields(cls))})")
        return cls(**values)


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeepInferError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DeepInferError(f"unknown {name} {value!r} (expected one of {', '.join(choices)})")


def parse_device(device: str | torch.device) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` as a torch.device; a one-line error for anything else."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise DeepInferError(f"unknown device {device!r} (expected cpu, cuda or cuda:N)")
    return resolved


def resolve_device(device: str | torch.device) -> torch.device:
    """`parse_device`, and a one-line error for CUDA on a machine without it (checked before any work,
    so a failed start writes nothing)."""
    resolved = parse_device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DeepInferError(f"device {device!r} requested but CUDA is not available")
    return resolved


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per `EngineConfig` field not in `skip`: `--max-num-seqs` and so on, `--run-seed` for
    `seed`, and for a setting on by default its `--no-...` flag (`--no-chunked-prefill` for
    `enable_chunked_prefill`, `--no-cuda-graphs`, ...); defaults are the fields' defaults."""
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if "off" in f.metadata:
            flag, off_help = f.metadata["off"]
            parser.add_argument(flag, dest=f.name, action="store_false", default=f.default, help=off_help)
        elif f.name == "seed":
            parser.add_argument("--run-seed", dest="run_seed", type=int, default=f.default, help=help_text)
        else:
            # values are checked by EngineConfig: one-line errors
            kind = int if f.type.startswith("int") else float if f.type.startswith("float") else str
            choices = f.metadata.get("choices")
            parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                                help=help_text + (f"; one of {', '.join(choices)}" if choices else ""))


def config_from_flags(args: argparse.Namespace, **given) -> EngineConfig:
    """The `EngineConfig` of parsed `add_engine_flags` flags; `given` supplies skipped fields."""
    values = {f.name: getattr(args, _dest(f.name)) for f in fields(EngineConfig) if hasattr(args, _dest(f.name))}
    return EngineConfig(**{**values, **given})


def _dest(name: str) -> str:
    """Where argparse keeps a field's flag (`--run-seed` for `seed`: commands have a request `--seed`)."""
    return "run_seed" if name == "seed" else name
