"""transformers' own DeepSeek-V4 model on the weights our engine serves: the comparison `gpu_bench` reports.

    python benchmarks/transformers_bench.py --preset flash-4l --out results.json

Builds `transformers.DeepseekV4ForCausalLM` from the preset's config.json content and loads the same
seeded random tensors our engine builds (`stored_random_tensors`, the checkpoint's names; transformers
converts them as `from_pretrained` does). Then, eager as transformers ships it (bf16, greedy, its
KV cache): ms per decode step at each batch size after `--context`-token prompts (all of one length,
so nothing is padded), and tokens/s of a prefill of `PREFILL` prompts in one forward.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from deepinfer.checkpoint import preset_config
from deepinfer.checkpoint.random_init import stored_random_tensors

PREFILL = (8, 2048)
SEED = 0


def load(preset: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The preset's model in transformers, with our seeded weights (every tensor, none left over)."""
    config = transformers.AutoConfig.for_model(**preset_config(preset).to_dict())
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    tensors = dict(stored_random_tensors(preset_config(preset), SEED, dtype, device, include_mtp=False))
    model, info = model_class.from_pretrained(None, config=config, state_dict=tensors, dtype=dtype,
                                              output_loading_info=True)  # (device_map would need accelerate)
    wrong = {kind: names for kind, names in info.items() if names}
    if wrong:
        raise RuntimeError(f"transformers did not take our tensors as they are: {wrong}")
    return model.to(device).eval()


def prompts(batch: int, length: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(16, 4000, (batch, length), generator=gen).to(device)


@torch.no_grad()
def decode_ms(model: torch.nn.Module, batch: int, context: int, steps: int) -> float:
    """Median ms of one greedy decode step with transformers' cache, after a `context`-token prefill."""
    out = model(prompts(batch, context, model.device), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


@torch.no_grad()
def prefill_tokens_per_s(model: torch.nn.Module) -> float:
    count, length = PREFILL
    ids = prompts(count, length, model.device)
    seconds = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return count * length / seconds[-1]


def measure(preset: str, batches: list[int], context: int, steps: int, dtype: str = "bfloat16") -> dict:
    model = load(preset, getattr(torch, dtype), "cuda")
    report = {"transformers": transformers.__version__, "preset": preset, "dtype": dtype, "context": context,
              "decode": [], "prefill": {}}
    for batch in batches:
        report["decode"].append({"batch": batch, "step_ms": round(decode_ms(model, batch, context, steps), 3)})
        print(json.dumps(report["decode"][-1]), flush=True)
    count, length = PREFILL
    report["prefill"] = {"prompts": count, "prompt_tokens": length,
                         "tokens_per_s": round(prefill_tokens_per_s(model), 1)}
    print(json.dumps(report["prefill"]), flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="flash-4l")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    report = {"command": "python " + " ".join(a if a != args.out else Path(args.out).name for a in sys.argv),
              "device": torch.cuda.get_device_name(), **measure(args.preset, args.batches, args.context, args.steps)}
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
