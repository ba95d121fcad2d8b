"""The library code paths a CPU can take, each run in its own process: the start self-test and a small
engine invariance check under each, and the bits each path gives.

MKL and oneDNN pick their code path once per process, from the CPU and from environment variables,
so the paths another machine takes can be reached here by setting those variables: MKL's AVX2 path
(what MKL runs on AVX2-only Intel CPUs, and the path whose kernels depend on the row count), its
AVX-512 path, its strict and compatible reproducibility modes (MKL_CBWR; COMPATIBLE runs the generic
code MKL also runs on AMD CPUs), oneDNN capped at AVX2 or at AVX512_CORE (AVX-512 without bf16
instructions), and a whole AVX2-only CPU such as AMD's Zen 2 and Zen 3 (`avx2-cpu`: PyTorch's own
vectorised kernels, whose instruction set changes bits too, oneDNN and MKL all at AVX2). An Intel
machine exercises what an AMD one runs and the other way round, as far as the libraries let
environment variables decide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LIBRARY_PATHS: dict[str, dict[str, str]] = {
    "default": {},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-avx2-strict": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT"},
    "mkl-avx512-strict": {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "MKL_CBWR": "AVX512,STRICT"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "onednn-avx512-core": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2-cpu": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
PATH_VARIABLES = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                  "DEEPINFER_ALLOW_VARIANT_CPU", "DEEPINFER_ALLOW_VARIANT_BF16")
THREADS = 2
ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter: the self-test per dtype, then the tiny preset's requests served alone
# and all together (batch 1 against batch 8) with their token ids and logprob bits hashed.
_CHILD = """
import hashlib, json, torch
torch.set_num_threads({threads})
from deepinfer import kernels
from deepinfer.kernels import cpu_isa, selftest
from deepinfer import LLM, SamplingParams

def digest(outputs):
    h = hashlib.sha256()
    for out in outputs:
        h.update(json.dumps([out.token_ids, [float(v).hex() for v in out.logprobs],
                             [float(v).hex() for v in out.prompt_logprobs or []]]).encode())
    return h.hexdigest()

gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in (3, 40, 17, 70, 5, 33, 64, 9)]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=True)
report = {{"path": selftest.library_path(), "dtypes": {{}}}}
for dtype in ("float32", "bfloat16"):
    entry = report["dtypes"][dtype] = {{}}
    bf16_problem = cpu_isa.isa_problem(cpu_isa.onednn_state()) if dtype == "bfloat16" else None
    entry["refused"] = bf16_problem
    tiles = selftest.proven_row_tiles((torch.float32, getattr(torch, dtype)))
    entry["row_tiles"] = list(tiles.candidates[getattr(torch, dtype)])
    entry["variant"] = selftest.variant_primitives(kernels.bind("batch_invariant", "cpu", tiles), getattr(torch, dtype))
    if bf16_problem or entry["variant"]:
        continue
    alone = LLM("preset:tiny", dtype=dtype, max_num_seqs=1, max_model_len=128).generate(prompts[:2], params)
    llm = LLM("preset:tiny", dtype=dtype, max_num_seqs=8, max_model_len=128)
    together = llm.generate(prompts, params)
    entry["batch_invariant"] = digest(alone) == digest(together[:2])
    entry["bits"] = digest(together)
    entry["row_tiles_by_shape"] = selftest.results()[dtype + ", {threads} threads"]["row_tiles_by_shape"]
print(json.dumps(report))
"""


def run_path(name: str, threads: int = THREADS) -> dict:
    """The report of one library path (see _CHILD), from a fresh Python process."""
    environ = {k: v for k, v in os.environ.items() if k not in PATH_VARIABLES}
    result = subprocess.run([sys.executable, "-c", _CHILD.format(threads=threads)], cwd=ROOT,
                            env={**environ, **LIBRARY_PATHS[name]}, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"library path {name}: {result.stderr.strip().splitlines()[-1]}")
    return {"environment": LIBRARY_PATHS[name], **json.loads(result.stdout.splitlines()[-1])}


def run_paths(names: list[str] | None = None, parallel: int = 2) -> dict[str, dict]:
    """Every named library path's report (all of LIBRARY_PATHS by default), `parallel` processes at a time."""
    names = list(LIBRARY_PATHS) if names is None else names
    with ThreadPoolExecutor(parallel) as pool:
        return dict(zip(names, pool.map(run_path, names)))
