"""kernels.cpu_isa: batch-invariant bf16 refuses to run when oneDNN uses AMX (the cap was set too late,
or the environment allows AMX), and manifests record what oneDNN uses. Each case runs in a fresh
Python process, since oneDNN settles its instruction set once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cpu_paths import bf16_refusal
from deepinfer.kernels import cpu_isa
from deepinfer.kernels.invariant import check_cpu_isa

REPO = Path(__file__).resolve().parent.parent
needs_amx = pytest.mark.skipif(not cpu_isa.cpu_has_amx(), reason="the CPU has no amx_bf16")

BF16_MATMUL_FIRST = ("import torch; torch.nn.functional.linear(torch.ones(2, 8).bfloat16(), "
                     "torch.ones(8, 8).bfloat16())\n")
FP32_MATMUL_FIRST = "import torch; torch.nn.functional.linear(torch.ones(2, 8), torch.ones(8, 8))\n"
CHECK = """
from deepinfer import LLM
from deepinfer.kernels.cpu_isa import check_cpu_isa
try:
    LLM("preset:tiny", dtype="bfloat16", max_model_len=64)  # a bf16 engine checks what oneDNN uses
    print("ok:", check_cpu_isa())
except Exception as err:
    print(f"{type(err).__name__}: {err}")
"""
TOO_LATE = (
    "DeepInferError: oneDNN is using AMX bf16 kernels (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 was set after the "
    "process's first matmul, too late to take effect): bf16 rows would depend on the batch; import deepinfer "
    "before running any matmul (fp32 ones too), or set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 before starting Python"
)
ALLOWS_AMX = (
    "DeepInferError: oneDNN is using AMX bf16 kernels (ONEDNN_MAX_CPU_ISA is set to AVX512_CORE_AMX, which allows "
    "AMX): bf16 rows would depend on the batch; unset ONEDNN_MAX_CPU_ISA or set it to AVX512_CORE_BF16"
)


def _python(code: str, **env: str) -> list[str]:
    """stdout lines of `code` in a fresh interpreter, without ONEDNN_MAX_CPU_ISA and the waiver unless given."""
    environ = {k: v for k, v in os.environ.items() if k not in (cpu_isa.ISA_VARIABLE, cpu_isa.WAIVER_VARIABLE)}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**environ, **env}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


WAIVER_RECORD = ("from deepinfer.harness.environment import environment_fingerprint\n"
                 "print(json.dumps(environment_fingerprint()['torch_cpu']))\n")
# each fresh-interpreter case of the tests below: (code, environment); `fresh` runs them
CASES = {
    "bf16-first": (BF16_MATMUL_FIRST + CHECK, {}),
    "fp32-first": (FP32_MATMUL_FIRST + CHECK, {}),
    "allows-amx": (CHECK, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}),
    "import-first": (CHECK + "print(1 + 1)\n", {}),  # prints after the probe still reach stdout
    "waiver": ("import json\n" + CHECK + WAIVER_RECORD,
               {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "DEEPINFER_ALLOW_VARIANT_BF16": "1"}),
}


@pytest.fixture(scope="module")
def fresh() -> dict[str, list[str]]:
    """stdout lines of each of CASES, run two at a time (each spends ~2 s starting Python and torch)."""
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(lambda case: _python(case[0], **case[1]), CASES.values())))


@needs_amx
@pytest.mark.parametrize("first", ["bf16-first", "fp32-first"], ids=["bf16", "fp32"])
def test_a_matmul_before_import_leaves_amx_on_and_the_check_refuses(fresh, first):
    assert fresh[first] == [TOO_LATE]


@needs_amx
def test_an_environment_that_allows_amx_is_refused(fresh):
    assert fresh["allows-amx"] == [ALLOWS_AMX]


@needs_amx
def test_importing_first_caps_onednn_below_amx(fresh):
    lines = fresh["import-first"]
    assert lines[0].startswith("ok: oneDNN capped at AVX512_CORE_BF16 (AMX available, not used; bf16 matmuls: ")
    assert "amx" not in lines[0].lower().replace("amx available", "") and lines[1:] == ["2"]


@needs_amx
def test_the_waiver_runs_anyway_and_manifests_record_it(fresh):
    lines = fresh["waiver"]
    assert lines[0].startswith("ok: oneDNN uses AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX; bf16 matmuls: ")
    assert lines[0].endswith(" on the batch (accepted by DEEPINFER_ALLOW_VARIANT_BF16=1)")
    recorded = json.loads(lines[1])
    assert recorded["onednn_max_cpu_isa"] == "AVX512_CORE_AMX"
    onednn = recorded["onednn"]
    assert (onednn["amx_used"], onednn["amx_available"], onednn["allow_variant_bf16"]) == (True, True, True)
    assert "AMX" in onednn["isa"] and onednn["summary"] == lines[0].removeprefix("ok: ")


def test_this_process_passes_the_check_and_its_manifests_say_so():
    if refusal := bf16_refusal():
        pytest.skip(f"this process runs under a cap that refuses bf16 (the tests above check that): {refusal}")
    state = cpu_isa.onednn_state()
    assert check_cpu_isa() == state["summary"]
    assert not state["amx_used"]
    assert state["requested"] == os.environ["ONEDNN_MAX_CPU_ISA"]
    from deepinfer.harness.environment import environment_fingerprint

    assert environment_fingerprint()["torch_cpu"]["onednn"] == state


def test_verbose_lines_are_parsed_for_the_isa_and_the_matmul_kernels():
    lines = [
        "onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)",
        "onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions",
        "onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:bf16,undef,src:bf16::blocked:ab::f0,,,4x64:64x64,1",
        "onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:f32::blocked:ab::f0,,,4x64,0.1",
        "onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:bf16,undef,src:bf16::blocked:ab::f0,,,2x64:64x64,1",
    ]
    isa = "Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions"
    assert cpu_isa._parse(lines) == (isa, ["gemm:jit:bf16"], [])
    inner = "onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core,forward_inference,src:f32,,,mb2,1"
    assert cpu_isa._parse(lines + [inner]) == (isa, ["gemm:jit:bf16"], ["brg_matmul:avx512_core"])


def test_a_cap_without_amx_is_left_to_the_start_self_test():
    """No functional probe refuses gemm:jit:bf16 (the AVX512_CORE cap): the self-test measures it at the
    call shapes the engine makes (tests/test_cpu_paths.py runs it under that cap)."""
    state = {"requested": "AVX512_CORE", "isa": None, "bf16_matmul": "gemm:jit:bf16", "amx_available": True,
             "amx_used": False, "allow_variant_bf16": False}
    assert cpu_isa.isa_problem(state) is None
    assert cpu_isa.describe(state) == "oneDNN capped at AVX512_CORE (AMX available, not used; bf16 matmuls: gemm:jit:bf16)"


def test_an_unreadable_verbose_output_is_said_and_leaves_the_self_test_to_decide():
    state = {"requested": "AVX512_CORE_BF16", "isa": None, "bf16_matmul": None, "amx_available": True,
             "amx_used": None, "allow_variant_bf16": False}
    assert cpu_isa.describe(state) == ("oneDNN capped at AVX512_CORE_BF16 (AMX use unknown; oneDNN's verbose "
                                       "output could not be read)")
    assert cpu_isa.isa_problem(state) is None
