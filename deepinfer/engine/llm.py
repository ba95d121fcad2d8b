"""The user-facing engine: `LLM(...).generate(prompts, params)`.

Data flows one way: request -> scheduler -> runner -> model -> sampler -> output. `LLM` is the face
over two owners: a `ModelHost` (`engine/host.py`: the loaded model, its layout and draft models,
shared by every engine over it) and an `EngineCore` (`engine/core.py`: intake, cache, scheduler,
runner and the step). It adds the loop (`stream`), the batch APIs and chat.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.core import EngineCore, RequestError
from deepinfer.engine.host import ModelHost
from deepinfer.errors import DeepInferError
from deepinfer.outputs import RequestOutput
from deepinfer.parallel import ExpertPlacement, gather_objects
from deepinfer.recipe.official import RESPONSE_PREFIX, ClientRequest, RecipeError, chat_body
from deepinfer.sampling_params import TOOL_CALL, SamplingParams


def _read_only(owner: str, name: str) -> property:
    """`name` of the LLM's `owner` (its host or its engine core), which alone changes it (methods too:
    `llm.step` is `llm.core.step`)."""
    return property(lambda self: getattr(getattr(self, owner), name), doc=f"`{owner}.{name}`")


class LLM:
    """An offline engine over one checkpoint, run as an `EngineConfig` says (`config=`, or its fields
    as keyword arguments).

    `model` is a checkpoint folder, None for the embedded default (`DEFAULT_PRESET`), or `"preset:NAME"` for
    seeded random weights of a preset built directly on `device` (nothing written to disk).
    `numerics="batch_invariant"` (default) makes each request's tokens and logprob bits independent
    of batching and scheduling; `"fast"` uses plain library kernels and does not promise that.

    `max_model_len=None` (default) takes the context from the model (one rule,
    `deepinfer.engine.cache.default_max_model_len`): its max_position_embeddings, or, when the default
    cache for `max_num_seqs` sequences of that length does not fit in half the memory left after the
    weights (CUDA: free device memory; CPU: physical RAM minus the weights), the largest multiple of
    `block_size` that fits. `self.max_model_len` is the resolved value (runs record it).
    With `enable_chunked_prefill=False` a prompt cannot be split, so the step budget
    (`self.max_num_batched_tokens`) is raised to at least max_model_len.

    A request without `SamplingParams.seed` gets one derived from the engine `seed` and:
    `unseeded_seeds="request_order"` (default, what vLLM-style engines do) the engine's request
    counter, so it depends on how many requests the engine served before; `"content"` a SHA-256 of
    the request (prompt token ids and sampling params), so the same unseeded request draws the same
    tokens whatever came before it or beside it. Either way the seed is in the output
    (`RequestOutput.seed`), so any output can be reproduced by passing it back.
    """


    model, config, tokenizer, layout, device, dtype, numerics, model_id, stored_formats, weight_storage = (
        _read_only("host", name) for name in ("model", "config", "tokenizer", "layout", "device", "dtype", "numerics",
                                              "model_id", "stored_formats", "weight_storage"))
    engine_config, max_model_len, max_num_batched_tokens, cache, scheduler, runner = (
        _read_only("core", name) for name in ("engine_config", "max_model_len", "max_num_batched_tokens", "cache",
                                              "scheduler", "runner"))
    tokenize, encode, check_params, has_unfinished, step = (
        _read_only("core", name) for name in ("tokenize", "encode", "check_params", "has_unfinished", "step"))

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, **settings) -> None:
        if config is not None and settings:
            raise DeepInferError(f"pass engine settings either as config= or as keywords, not both "
                                 f"(got config and {', '.join(sorted(settings))})")
        if config is None:
            config = EngineConfig.from_dict(settings, where="LLM")
        self.host = ModelHost(model, config)
        self.core = EngineCore(self.host, config)

    def with_engine(self, config: EngineConfig) -> LLM:
        """Another engine over this one's loaded model (the weights are shared, nothing is reloaded),
        run as `config` says: its scheduling, cache and seed settings may differ, the settings that
        decide how the model was built (`host.MODEL_SETTINGS`) may not. Serve with one of them at a time."""
        self.host.check_engine(config)
        other = object.__new__(LLM)
        other.host, other.core = self.host, EngineCore(self.host, config)
        return other

    # requests in -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue one request as number `request_id` (default: the next; ranks serving shares of one
        list give each request the same number); it joins the running batch at the next `step()`."""
        return self.core.enqueue(self.encode(prompt), self.check_params(params), request_id)

    def submit(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[int]:
        """Queue every prompt, all checked first (a bad one queues none); their request ids, in prompt
        order. Every rank of a launch is given every prompt and queues its share (all of them unless
        data parallel), under ids the ranks agree on."""
        if not isinstance(prompts, list):
            raise RequestError("prompts must be a list (of strings or of token-id lists)")
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        checked = [self.check_params(sp) for sp in per_prompt]
        ids = [self.core.next_id + i for i in range(len(prompts))]
        for index, (p, sp) in enumerate(zip(encoded, checked)):
            if self.layout.serves(index):  # every request, unless data parallel gives each rank a share
                self.core.enqueue(p, sp, ids[index])
        self.core.next_id = ids[-1] + 1 if ids else self.core.next_id
        return ids

    # the loop ----------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, freeing the blocks only the prefix cache held (requests in
        flight keep theirs): the next requests compute their prompts in full."""
        self.scheduler.reset_prefix_cache()

    def stream(self, arrive: Callable[[], bool] | None = None) -> Iterator[list[RequestOutput]]:
        """The engine loop: step until no rank has work, yielding the requests each step finished, every
        rank's (a launch of several processes gathers them after each step, one copy per group of ranks
        that share requests; a rank with nothing to run still steps while others work, in lockstep).
        `arrive`, called before each step, may queue requests and says whether more are still to
        come (they count as work)."""
        while True:
            working = (arrive is not None and arrive()) or self.has_unfinished()
            finished = self.step() if working or self.layout.lockstep else []
            if self.layout.world > 1:
                shares = gather_objects((working, finished))
                working = any(share[0] for share in shares)
                finished = [output for share in shares[::self.layout.attention_ranks] for output in share[1]]
            yield finished
            if not working:
                return

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in prompt order."""
        if self.has_unfinished():
            raise RequestError("generate() needs an idle engine: finish requests queued with add_request() via step()")
        ids = self.submit(prompts, params)
        done = {output.request_id: output for finished in self.stream() for output in finished}
        return [done[i] for i in ids]

    # experts across ranks ------------------------------------------------------------------------

    def expert_loads(self) -> list[list[int]]:
        """See `ModelHost.expert_loads` (a collective)."""
        return self.host.expert_loads()

    @property
    def expert_placements(self) -> list[ExpertPlacement]:
        """Where each MoE layer's experts are now ([] without expert parallelism)."""
        return [exchange.placement for exchange in self.host.exchanges]

    def place_experts(self, placements: list[ExpertPlacement]) -> None:
        """Move the experts to `placements` (one per MoE layer) between steps: the weights travel
        between ranks and routing follows (a collective). Outputs stay the same bits."""
        if self.core.in_flight is not None:
            raise DeepInferError("place_experts between steps: a step is in flight")
        self.host.place_experts(placements)

    def chat(
        self,
        conversations: list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        thinking: bool = False,
        tool_choice: str | dict | None = None,
    ) -> list[RequestOutput]:
        """Generate the next assistant turn of each conversation (OpenAI Chat Completions messages),
        prompted and parsed as DeepSeek's API does (`recipe.official`, the family's official encoding);
        each output carries the parsed assistant `message` (content, reasoning_content, tool_calls).
        `params` are the engine's, whole; a request whose params say `structured="tool_call"` is
        constrained to DSML calls of `tools` as `tool_choice` forces them ("required" or a named
        function: `recipe.dsml`)."""
        bodies = [chat_body(messages, tools, tool_choice, thinking) for messages in conversations]
        requests = self._client_requests(bodies, "chat", "conversation")
        per_prompt = params if isinstance(params, list) else [params] * len(requests)
        protocol = self.host.protocol()
        per_prompt = [replace(p, structured=protocol.constraint(r, tool_calls_only=True))
                      if p is not None and p.structured == TOOL_CALL else p for p, r in zip(per_prompt, requests)]
        outputs = self.generate([r.prompt_ids for r in requests], per_prompt)
        for output, request in zip(outputs, requests):
            if output.finish_reason != "error":
                output.message = protocol.message(request, f"chatcmpl-{output.request_id}", output.token_ids,
                                                  output.finish_reason)
        return outputs

    def respond(self, bodies: list[dict], format: str = "chat") -> list[dict]:
        """Answer client request bodies (`format`: "chat" Chat Completions, "messages" Anthropic
        Messages, "responses" OpenAI Responses) as DeepSeek's API would: each converted and encoded by
        the official recipe, sampled with the settings it carries (max_tokens as the recipe resolves it
        for the context, the engine's defaults for what it leaves out; its JSON schema or forced tool
        calls enforced), and answered with the recipe's response object. A request the engine fails
        answers `{"error": {"kind", "message"}}`."""
        requests = self._client_requests(bodies, format, "request")
        protocol = self.host.protocol()
        params = []
        for i, request in enumerate(requests):
            try:
                params.append(SamplingParams(**{**request.carried, "max_tokens": request.max_tokens(self.max_model_len),
                                                "structured": protocol.constraint(request)}))
            except DeepInferError as err:
                raise RecipeError(f"request {i}: {err}", kind=err.kind) from None
        outputs = self.generate([r.prompt_ids for r in requests], params)
        responses = []
        for output, request in zip(outputs, requests):
            if output.finish_reason == "error":
                responses.append({"error": {"kind": output.error_kind, "message": output.error}})
                continue
            responses.append(protocol.respond(request, f"{RESPONSE_PREFIX[format]}-{output.request_id}",
                                              output.token_ids, output.finish_reason, output.logprobs,
                                              output.top_logprobs))
        return responses

    def _client_requests(self, bodies: list[dict], format: str, what: str) -> list[ClientRequest]:
        protocol = self.host.protocol()
        requests = []
        for i, body in enumerate(bodies):
            try:
                requests.append(protocol.request(body, format))
            except DeepInferError as err:
                raise RecipeError(f"{what} {i}: {err}", kind=err.kind) from None
        return requests
