"""What a decode step's forward launches on CUDA, PyTorch ops and Triton kernels, counted on a CPU machine.

    python benchmarks/cuda_op_count.py [--preset v41-tiny] [--top 30] [--out counts.json]

Binds the invariant CUDA table (`kernels.bind("batch_invariant", "cuda")`: the Triton matmuls, norms,
attention and fused ops) to a model on the CPU, its Triton kernels run by the interpreter, and counts
the PyTorch ops one decode step's forward dispatches outside them, by the innermost line of ours that
called each, and the Triton kernels it launches, by kernel; both also by the target layer running them.
On the GPU each is a kernel launch (a few microseconds in a decode step however small), so the lines and
layers with the most are where fusing pays. Ops that launch nothing are left out: views, empty
tensors, scalars read from CPU tensors, and casts or `contiguous` calls that return their input. The
model is built for the CPU, so a weight laid out for oneDNN (column-major) shows a copy the GPU build
does not make; the counts are otherwise the GPU's op chains. No GPU time: a proxy to choose what to
fuse before a profile on the device (`decode_step_profile.py`) confirms it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from deepinfer import LLM, EngineConfig, SamplingParams  # noqa: E402
from deepinfer.engine import host  # noqa: E402
from deepinfer.kernels import cpu_isa, invariant  # noqa: E402
import deepinfer.kernels as kernels  # noqa: E402

SILENT = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach", "detach_", "item",
          "_local_scalar_dense", "view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "reshape",
          "flatten", "unflatten", "expand", "t", "transpose", "permute", "split", "split_with_sizes", "unbind",
          "alias", "as_strided", "chunk", "narrow", "view_as", "expand_as", "movedim"}
MAYBE_SILENT = {"to", "_to_copy", "contiguous", "clone"}  # silent where they return their input


class Counting(TorchDispatchMode):
    """Counts the ops that launch something, by the innermost frame under `root` that called them
    (ops inside the interpreter's Triton kernels are theirs, not ours: left out), and the Triton
    kernels launched, by name; both also by the target layer running them."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self.sites: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()
        self.by_layer: collections.Counter = collections.Counter()
        self.sequence: collections.defaultdict = collections.defaultdict(list)  # layer -> its launches in order
        self.layer = "outside the target's layers"

    def attribute_layers(self, layers) -> None:
        """Count each launch also by the target layer (a block of `layers`) running it."""
        def entering(index):
            def enter(module, args):
                role = getattr(module, "role", None)
                kind = f" ({role.kind}{', engram' if role.engram else ''})" if role else ""
                self.layer = f"layer {index:2d}{kind}"
            return enter

        for index, block in enumerate(layers):
            block.register_forward_pre_hook(entering(index))
            block.register_forward_hook(lambda module, args, out: setattr(self, "layer", "outside the target's layers"))

    def __enter__(self):
        launch = InterpretedFunction.run

        def counted(function, *args, warmup=False, **kwargs):
            if not warmup:
                self.kernels[function.fn.__name__] += 1
                self.by_layer[self.layer] += 1
                self.sequence[self.layer].append(f"triton {function.fn.__name__}")
            return launch(function, *args, warmup=warmup, **kwargs)

        self._launch, InterpretedFunction.run = launch, counted
        return super().__enter__()

    def __exit__(self, *exc):
        InterpretedFunction.run = self._launch
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in SILENT or (name in MAYBE_SILENT and isinstance(out, torch.Tensor) and args
                              and isinstance(args[0], torch.Tensor) and out.data_ptr() == args[0].data_ptr()):
            return out
        stack = traceback.extract_stack()
        if any("triton/runtime" in frame.filename for frame in stack):
            return out
        ours = [frame for frame in stack[:-1] if frame.filename.startswith(self.root)
                and "site-packages" not in frame.filename and frame.filename != __file__]
        site = f"{Path(ours[-1].filename).relative_to(self.root)}:{ours[-1].lineno} {ours[-1].line}" if ours else "?"
        self.sites[site] += 1
        self.ops[name] += 1
        self.by_layer[self.layer] += 1
        self.sequence[self.layer].append(f"{name} at {site}")
        return out


def cuda_table_on_cpu() -> kernels.Ops:
    """The invariant CUDA table, bound for CPU tensors: libdevice's exp, cos, sin, log, log1p and rsqrt
    (which the interpreter lacks) become the interpreter's (log1p as log(1 + x), rsqrt as 1 / sqrt: only
    launches are counted), and the CPU start self-test is skipped (it checks CPU primitives)."""
    for name in ("exp", "cos", "sin", "log"):
        setattr(libdevice, name, lambda x, _name=name, **_: getattr(triton.language, _name)(x))
    libdevice.log1p = lambda x, **_: triton.language.log(x + 1.0)
    libdevice.rsqrt = lambda x, **_: 1.0 / triton.language.sqrt(x)
    return kernels.Ops("batch_invariant", "cuda", kernels._table("batch_invariant", "cuda", invariant.CANONICAL),
                       invariant.CANONICAL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v41-tiny")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30, help="lines printed, most launches first")
    parser.add_argument("--speculation", default="off",
                        help="a drafter: count a whole engine step that verifies --draft-tokens drafts and drafts "
                             "after it (sampling and the drafter's pass included) instead of the forward alone")
    parser.add_argument("--draft-tokens", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0, help="the request's (a whole step's sampling)")
    parser.add_argument("--sequence", type=int, metavar="LAYER", help="also print this layer's launches in order")
    parser.add_argument("--out", help="write the counts as JSON here")
    args = parser.parse_args()
    ops = cuda_table_on_cpu()
    host.checked_cpu_ops = lambda dtype: ops
    speculating = args.speculation != "off"
    llm = LLM(f"preset:{args.preset}", EngineConfig(
        max_model_len=4 * args.prompt_tokens, async_scheduling=False, dtype="bfloat16",
        **(dict(speculation=args.speculation, draft_tokens=args.draft_tokens, verify_policy="fixed") if speculating else {})))
    llm.add_request(list(range(5, 5 + args.prompt_tokens)),
                    SamplingParams(temperature=args.temperature, max_tokens=32, ignore_eos=True, seed=1))
    while not llm.scheduler.running or len(llm.scheduler.running[0].output_token_ids) < 2:
        llm.step()
    counting = Counting(str(Path(__file__).resolve().parents[1]) + os.sep)
    counting.attribute_layers(next(module.layers for module in llm.model.modules()  # V4 nests its decoder
                                   if isinstance(getattr(module, "layers", None), torch.nn.ModuleList)))
    if speculating:
        what = "engine step verifying drafts and drafting after it"
        with torch.inference_mode(), counting:
            llm.step()
    else:
        what = "decode forward"
        scheduled = llm.scheduler.schedule()  # a decode step, counted but never run by the engine
        batch, _ = llm.runner.build_batch(scheduled.chunks)
        with torch.inference_mode(), counting:
            llm.model(batch, llm.cache.layer_views)
    total = sum(counting.sites.values())
    triton_launches = sum(counting.kernels.values())
    layers = llm.config.num_hidden_layers
    by_file = collections.Counter()
    for site, count in counting.sites.items():
        by_file[site.split(":")[0]] += count
    print(f"{args.preset}: {total + triton_launches} kernel launches in one {what} "
          f"({(total + triton_launches) / layers:.0f} a target layer): {total} PyTorch ops, {triton_launches} Triton")
    for layer, count in sorted(counting.by_layer.items()):
        print(f"{count:5d}  {layer}")
    for kernel, count in counting.kernels.most_common():
        print(f"{count:5d}  triton {kernel}")
    for file, count in by_file.most_common():
        print(f"{count:5d}  {file}")
    for site, count in counting.sites.most_common(args.top):
        print(f"{count:5d}  {site[:140]}")
    if args.sequence is not None:
        layer = next((name for name in counting.sequence if name.startswith(f"layer {args.sequence:2d}")), None)
        if layer is None:
            sys.exit(f"error: --sequence {args.sequence}: the target has layers 0 to {layers - 1}")
        print(f"{layer}, in order:")
        for number, launch in enumerate(counting.sequence[layer], 1):
            print(f"{number:5d}  {launch[:140]}")
    if args.out:
        command = " ".join(["python", "benchmarks/cuda_op_count.py"]
                           + [a if a != args.out else Path(args.out).name for a in sys.argv[1:]])
        device = f"cpu ({cpu_isa.cpu_model()}), the invariant CUDA table under the Triton interpreter"
        Path(args.out).write_text(json.dumps({"command": command, "device": device, "preset": args.preset,
                                              "counted": what, "layers": layers, "launches": total,
                                              "triton_launches": triton_launches,
                                              "by_layer": dict(sorted(counting.by_layer.items())),
                                              "by_kernel": dict(counting.kernels.most_common()),
                                              "by_file": dict(by_file.most_common()),
                                              "by_op": dict(counting.ops.most_common()),
                                              "by_line": dict(counting.sites.most_common())}, indent=1))


if __name__ == "__main__":
    main()
