"""The user-facing engine: `LLM(...).generate(prompts, params)`.

Data flows one way: request -> scheduler -> runner -> model -> sampler -> output.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import kernels
from deepinfer.checkpoint import default_checkpoint, load_checkpoint, preset_config, random_tensors
from deepinfer.config import ModelConfig
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, Status
from deepinfer.errors import DeepInferError
from deepinfer.model import DeepseekV4
from deepinfer.outputs import RequestOutput
from deepinfer.recipe.chat import ChatFormatError, encode_chat, parse_completion
from deepinfer.recipe.tokenizer import TextTokenizer, build_tokenizer
from deepinfer.sampling_params import SamplingParams, derive_seed

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
PRESET_PREFIX = "preset:"


class RequestError(DeepInferError, ValueError):
    """A prompt the engine cannot serve."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DeepInferError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    return DTYPES[dtype]


class LLM:
    """An offline engine over one checkpoint.

    `model` is a checkpoint folder, None for the embedded `tiny` default, or `"preset:NAME"` for
    seeded random weights of a preset built directly on `device` (nothing written to disk).
    `numerics="batch_invariant"` (default) makes each request's tokens and logprob bits independent
    of batching and scheduling; `"fast"` uses plain library kernels and does not promise that.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        num_cache_blocks: int | None = None,
        block_size: int = 16,
        enable_chunked_prefill: bool = True,
        numerics: str = "batch_invariant",
        seed: int = 0,
    ) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise DeepInferError(f"{name} must be a positive integer, got {value!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise DeepInferError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if numerics not in kernels.NUMERICS:
            raise DeepInferError(f"unknown numerics {numerics!r} (expected one of {', '.join(kernels.NUMERICS)})")
        self.numerics = numerics
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeepInferError("device='cuda' requested but CUDA is not available")
        self.dtype = resolve_dtype(dtype)
        self.seed = seed
        config, tensors, self.tokenizer, self.model_id = self._load(model)
        self.config: ModelConfig = config
        self.max_model_len = max_model_len or min(config.max_position_embeddings, 4096)
        if self.max_model_len > config.max_position_embeddings:
            raise DeepInferError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{config.max_position_embeddings}"
            )
        self.model = DeepseekV4(config, self.dtype, device="meta")
        self.model.load_tensors(tensors, self.device, kernels.table(numerics, self.device.type)["matmul_layout"])
        self.has_mtp = any(name.startswith("mtp.") for name in tensors)
        del tensors
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.cache = CacheManager(
            config, self.model.cache_widths(), max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
            max_step_tokens=max_num_batched_tokens, num_blocks=num_cache_blocks, block_size=block_size,
            dtype=self.dtype, device=self.device,
        )
        self.scheduler = Scheduler(
            self.cache, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=enable_chunked_prefill,
        )
        self.runner = ModelRunner(self.model, self.cache, self.device, numerics)
        self._next_id = 0

    def _load(self, model: str | Path | None):
        if isinstance(model, str) and model.startswith(PRESET_PREFIX):
            config = preset_config(model[len(PRESET_PREFIX):])
            tensors = random_tensors(config, self.seed, self.dtype, device=self.device, include_mtp=False)
            return config, tensors, TextTokenizer(build_tokenizer(config.vocab_size)), f"{model}:seed={self.seed}"
        folder = Path(model) if model is not None else default_checkpoint()
        checkpoint = load_checkpoint(folder, device=self.device)
        tokenizer = TextTokenizer.from_folder(folder) if checkpoint.tokenizer_path else None
        return checkpoint.config, checkpoint.tensors, tokenizer, checkpoint.content_hash

    # requests in -------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer.json: pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt, add_bos=True)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                        or not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt token {bad!r} is not an id in [0, {self.config.vocab_size})")
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (room is needed to generate)"
            )
        if not self.chunked_prefill and len(ids) > self.max_num_batched_tokens:
            raise RequestError(
                f"prompt has {len(ids)} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens} "
                "with chunked prefill off"
            )
        return ids

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with this checkpoint")
        return params

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue one request; it joins the running batch at the next `step()`."""
        return self._enqueue(self.encode(prompt), self._check_params(params))

    def _enqueue(self, ids: list[int], params: SamplingParams) -> int:
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else derive_seed(self.seed, request_id)
        self.scheduler.add(Sequence(request_id, ids, params, seed))
        return request_id

    # the loop ----------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        chunks = self.scheduler.schedule()
        finished = []
        outputs = self.runner.step(chunks)
        now = time.perf_counter()
        for out in outputs:
            seq = out.chunk.seq
            seq.prompt_logprobs.extend(out.prompt_logprobs)
            seq.prompt_top_logprobs.extend(out.prompt_top_logprobs)
            if out.token is None:
                continue
            seq.token_ids.append(out.token)
            seq.logprobs.append(out.logprob)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if out.top is not None:
                seq.top_logprobs.append(out.top)
            if self._check_finished(seq, out.token):
                seq.status = Status.FINISHED
                finished.append(seq)
        self.scheduler.finish_step(chunks)
        return [self._output(seq) for seq in finished]

    def _check_finished(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if (token in self.config.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
            return True
        if params.stop:
            text = self.tokenizer.decode(seq.output_token_ids)
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                seq.text = text[: min(hits)]
                seq.finish_reason = "stop"
                return True
        if len(seq.output_token_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.text
        if text is None and self.tokenizer is not None:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop" and ids and (ids[-1] in seq.params.stop_token_ids
                                                        or ids[-1] in self.config.eos_token_ids):
                ids = ids[:-1]
            text = self.tokenizer.decode(ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason,
            seed=seq.seed,
            numerics=self.numerics,
            logprobs=list(seq.logprobs),
            top_logprobs=[list(t) for t in seq.top_logprobs] if seq.params.logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs else None,
            prompt_top_logprobs=[list(t) for t in seq.prompt_top_logprobs] if seq.params.prompt_logprobs else None,
            first_token_time=seq.first_token_time,
        )

    # batch APIs ---------------------------------------------------------------------------------

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in prompt order."""
        if not isinstance(prompts, list):
            raise RequestError("prompts must be a list (of strings or of token-id lists)")
        if self.has_unfinished():
            raise RequestError("generate() needs an idle engine: finish requests queued with add_request() via step()")
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        checked = [self._check_params(sp) for sp in per_prompt]
        ids = [self._enqueue(p, sp) for p, sp in zip(encoded, checked)]
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for output in self.step():
                done[output.request_id] = output
        return [done[i] for i in ids]

    def chat(
        self,
        conversations: list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        thinking: bool = False,
    ) -> list[RequestOutput]:
        """Generate the next assistant turn of each conversation (OpenAI Chat Completions messages);
        each output carries the parsed assistant `message` (content, reasoning, tool_calls)."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer: this checkpoint has no tokenizer.json")
        prompts = []
        for i, messages in enumerate(conversations):
            try:
                prompts.append(encode_chat(self.tokenizer, messages, tools=tools, thinking=thinking))
            except ChatFormatError as err:
                raise ChatFormatError(f"conversation {i}: {err}") from None
        outputs = self.generate(prompts, params)
        for output in outputs:
            output.message = parse_completion(output.text, thinking=thinking)
        return outputs
