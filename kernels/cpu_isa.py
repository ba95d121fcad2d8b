"""oneDNN's CPU instruction set: the cap batch-invariant bf16 needs, and a check that it took effect.

oneDNN's AMX bf16 matmul kernels make a row's bits depend on the number of rows in the call, so
importing this module (which `kernels.invariant` does) caps oneDNN below AMX: `ONEDNN_MAX_CPU_ISA` is
set to `ISA_CAP` unless the environment already sets it. oneDNN reads the variable once per process,
at the first matmul that consults it, and silently ignores it afterwards. Measured on this machine
(oneDNN 3.12 in PyTorch 2.13's CPU wheel, a Xeon with amx_bf16): an fp32 `F.linear` or `torch.bmm`
fixes the ISA just like a bf16 matmul does, so a process that ran any matmul before importing
deepinfer keeps AMX. Hence `check_cpu_isa`, which finds out what oneDNN actually uses.

How: `probe_onednn` runs a few bf16 matmuls with oneDNN's verbose mode on and the C-level stdout
(file descriptor 1) sent to a temporary file. oneDNN writes the ISA it settled on (an `isa:` info
line, once per process) and, for every call, the kernel that ran it (`brg_matmul:avx10_1_512_amx`,
`brg_matmul:avx512_core_bf16`, `gemm:jit:bf16`); AMX in either counts as AMX in use. That is the
reliable signal. Whether rows depend on the batch under the kernels oneDNN picked is measured at
the call shapes the engine really makes, by the start self-test (`kernels/selftest.py`); an earlier
functional check here (rows alone against one 64-row call, a shape batch-invariant matmuls no
longer make) refused the AVX512_CORE cap's gemm:jit:bf16 although the self-test passes it at the
fixed tile, on an AMD EPYC and on a Xeon. Under AMX, whether a row's bits differ depends on the data
(measured on a Xeon with amx_bf16: with one probe's data 2 rows matched and 4 or more did not), so
AMX stays refused on sight rather than left to a test with some data. Measured with the cap set in
time: AVX512_CORE_BF16 (brg_matmul:avx512_core_bf16), AVX512_CORE (gemm:jit:bf16) and AVX2 (oneDNN
runs no bf16 matmul at all; PyTorch computes it itself, so no verbose line appears).

The ISA is fixed for the process once a matmul has run, so it is probed once and cached.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"
ISA_CAP = "AVX512_CORE_BF16"
WAIVER_VARIABLE = "DEEPINFER_ALLOW_VARIANT_BF16"
# oneDNN's ISA names (it ignores their case) that leave AMX out; any other value (ALL, DEFAULT, a name
# with AMX, a name oneDNN does not know) lets oneDNN use AMX where the CPU has it.
BELOW_AMX = frozenset({
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
    "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_2_512",
})
PROBE_SHAPE = (8192, 512)  # (out_features, in_features): the small preset's vocabulary projection
VERBOSE_PREFIX = "onednn_verbose"

os.environ.setdefault(ISA_VARIABLE, ISA_CAP)  # no AMX: see the module docstring

_probed: dict | None = None


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str | None:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"), from /proc/cpuinfo."""
    return _cpuinfo("vendor_id")


def cpu_model() -> str | None:
    """The CPU's model name ("AMD EPYC 9B45", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz")."""
    return _cpuinfo("model name") or platform.processor() or None


def cpu_flags() -> list[str] | None:
    """The CPU's feature flags (sorted), from /proc/cpuinfo."""
    flags = _cpuinfo("flags")
    return None if flags is None else sorted(flags.split())


@contextlib.contextmanager
def cpu_threads(count: int | None) -> Iterator[None]:
    """Run the enclosed code with PyTorch's CPU thread count set to `count` (None: unchanged), restored
    afterwards (the bits of a CPU kernel may depend on the count: the self-test checks they do not)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_has_amx() -> bool | None:
    """Whether the CPU has AMX bf16 (the `amx_bf16` flag of /proc/cpuinfo); None where that cannot be read."""
    flags = cpu_flags()
    return None if flags is None else "amx_bf16" in flags


def waived() -> bool:
    """Whether DEEPINFER_ALLOW_VARIANT_BF16=1 turns check_cpu_isa's refusal into a statement (for
    measurements such as benchmarks/cpu_isa_pairs.py; manifests record it)."""
    return os.environ.get(WAIVER_VARIABLE) == "1"


def _flush_c_stdio() -> Callable[[], None]:
    try:
        libc = ctypes.CDLL(None)
        return lambda: libc.fflush(None)
    except (OSError, AttributeError):
        return lambda: None


@contextlib.contextmanager
def _capture_fd1(into: list[str]):
    """Everything written to file descriptor 1 meanwhile is appended to `into` as text instead."""
    flush = _flush_c_stdio()
    for stream in (sys.stdout, sys.__stdout__):
        with contextlib.suppress(Exception):
            stream.flush()
    flush()
    saved = os.dup(1)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                flush()
                os.dup2(saved, 1)
            sink.seek(0)
            into.append(sink.read().decode("utf-8", "replace"))
    finally:
        os.close(saved)


def _verbose_lines(run: Callable[[], None]) -> list[str] | None:
    """oneDNN's verbose lines while `run` runs; None where verbose mode or the capture is unavailable
    (then `run` still runs). Lines that are not oneDNN's (another thread's prints) are passed on."""
    captured: list[str] = []
    ran = False
    try:
        with _capture_fd1(captured), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            ran = True
            run()
    except (OSError, AssertionError, AttributeError):
        if ran:
            raise
        run()
        return None
    lines = captured[0].splitlines(keepends=True) if captured else []
    other = "".join(line for line in lines if not line.startswith(VERBOSE_PREFIX))
    if other:
        with contextlib.suppress(OSError):
            os.write(1, other.encode("utf-8"))
    return [line.strip() for line in lines if line.startswith(VERBOSE_PREFIX)]


def _parse(lines: list[str]) -> tuple[str | None, list[str], list[str]]:
    """(the `isa:` info line's text, the kernels of the bf16 matmul calls, those of the fp32 inner
    products) from oneDNN verbose lines."""
    isa, kernels, fp32 = None, [], []
    for line in lines:
        fields = line.split(",")
        if ",info,cpu,isa:" in line:  # the description may hold commas
            isa = line.split(",info,cpu,isa:", 1)[1].strip()
        if "exec" in fields:
            at = fields.index("exec")
            if len(fields) > at + 3 and fields[at + 2] in ("matmul", "inner_product"):
                into = kernels if fields[at + 2] == "matmul" else fp32
                if fields[at + 3] not in into:
                    into.append(fields[at + 3])
    return isa, kernels, fp32


def probe_onednn() -> dict:
    """What oneDNN does with bf16 matmuls in this process (probed once, then cached).

    requested: ONEDNN_MAX_CPU_ISA when probed; isa: oneDNN's own description of the ISA it uses
    (None when it printed none: no bf16 matmul went to oneDNN, or its verbose mode was unavailable or
    already used); bf16_matmul: the kernel(s) that ran the probe's bf16 matmuls (None: not oneDNN);
    fp32_matmul: the kernel of the fp32 inner product batch-invariant fp32 matmuls run on;
    amx_available: the CPU's amx_bf16 flag; amx_used: AMX in the ISA or in a kernel's name (None:
    unknown, oneDNN's verbose output could not be read).
    """
    global _probed
    if _probed is None:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(PROBE_SHAPE, generator=generator).to(torch.bfloat16)
        x = torch.randn(2, PROBE_SHAPE[1], generator=generator).to(torch.bfloat16)

        def run() -> None:
            F.linear(x, weight)
            if torch.backends.mkldnn.is_available():  # the fp32 inner product batch-invariant matmuls run on
                fp32 = weight[:64].float()
                torch.ops.mkldnn._linear_pointwise(x.float(), fp32.mT.contiguous().mT, None, "none", [], "")

        if torch.backends.mkldnn.is_available():
            lines = _verbose_lines(run)
        else:  # no oneDNN in this PyTorch: nothing to cap
            run()
            lines = []
        isa, kernels, fp32_kernels = _parse(lines or [])
        amx = "AMX" in (isa or "").upper() or any("amx" in k.lower() for k in kernels)
        _probed = {
            "requested": os.environ.get(ISA_VARIABLE),
            "isa": isa,
            "bf16_matmul": ", ".join(kernels) or None,
            "fp32_matmul": ", ".join(fp32_kernels) or None,
            "amx_available": cpu_has_amx(),
            "amx_used": amx if lines is not None or amx else None,
        }
    return dict(_probed)


_mkl: dict | None = None
MKL_HEADER = re.compile(r"architecture (?P<path>.+?), Lnx")
MKL_CNR = re.compile(r"CNR:(?P<cnr>\S+)")


def probe_mkl() -> dict:
    """MKL's code path in this process (probed once): `path`, the processors its kernels were chosen
    for, as MKL's verbose header names them ("Intel(R) Architecture processors" on AMD CPUs, an
    instruction set on Intel ones), and `cnr`, its conditional-reproducibility mode (MKL_CBWR). None
    where MKL's verbose output could not be read (or was already printed in this process)."""
    global _mkl
    if _mkl is None:
        captured: list[str] = []
        a, b = torch.ones(4, 64), torch.ones(64, 64)
        try:
            with _capture_fd1(captured), torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                torch.mm(a, b)
        except (OSError, AttributeError):
            pass
        text = "".join(captured)
        path, cnr = MKL_HEADER.search(text), MKL_CNR.search(text)
        _mkl = {"path": path["path"] if path else None, "cnr": cnr["cnr"] if cnr else None}
    return dict(_mkl)


MKL_GENERIC_PATH = "Intel(R) Architecture processors"  # MKL's generic kernels: AMD CPUs, and CBWR=COMPATIBLE


def mkl_isa_kernels() -> bool:
    """Whether MKL runs instruction-set kernels in this process (an Intel CPU's AVX-512 or AVX2 code),
    rather than its generic code or an unreadable path."""
    path = probe_mkl()["path"]
    return bool(path) and path != MKL_GENERIC_PATH


def mkl_path() -> str:
    """MKL's code path in one phrase, e.g. "for Intel(R) Architecture processors, CNR:OFF"."""
    mkl = probe_mkl()
    return f"for {mkl['path'] or 'processors not reported'}, CNR:{mkl['cnr'] or '?'}"


def onednn_state() -> dict:
    """What manifests record: probe_onednn's findings, `allow_variant_bf16` (DEEPINFER_ALLOW_VARIANT_BF16=1
    now) and `summary`, the one line `check_cpu_isa` returns."""
    state = {**probe_onednn(), "allow_variant_bf16": waived()}
    return {**state, "summary": describe(state)}


def isa_problem(state: dict) -> str | None:
    """Why batch-invariant bf16 cannot run under this oneDNN state (one line), or None when it can."""
    requested = state["requested"]
    if state["amx_used"]:
        if requested is None:
            why = f"{ISA_VARIABLE} is not set (deepinfer's cap was removed before the first matmul)"
            fix = f"set {ISA_VARIABLE}={ISA_CAP} before starting Python"
        elif requested.upper() in BELOW_AMX:
            why = (f"{ISA_VARIABLE}={requested} was set after the process's first matmul, too late to take "
                   "effect")
            fix = (f"import deepinfer before running any matmul (fp32 ones too), or set {ISA_VARIABLE}={ISA_CAP} "
                   "before starting Python")
        else:
            why = f"{ISA_VARIABLE} is set to {requested}, which allows AMX"
            fix = f"unset {ISA_VARIABLE} or set it to {ISA_CAP}"
        return f"oneDNN is using AMX bf16 kernels ({why}): bf16 rows would depend on the batch; {fix}"
    return None


def describe(state: dict) -> str:
    """The oneDNN state in one line, e.g. "oneDNN capped at AVX512_CORE_BF16 (AMX available, not used;
    bf16 matmuls: brg_matmul:avx512_core_bf16)"."""
    kernel = f"bf16 matmuls: {state['bf16_matmul']}" if state["bf16_matmul"] else "bf16 matmuls not run by oneDNN"
    if state["amx_used"]:
        line = f"oneDNN uses AMX ({ISA_VARIABLE}={state['requested']}; {kernel})"
    else:
        if state["amx_used"] is None:  # then only the start self-test speaks
            available, kernel = "AMX use unknown", "oneDNN's verbose output could not be read"
        else:
            available = {True: "AMX available, not used", False: "no AMX on this CPU",
                         None: "AMX not used"}[state["amx_available"]]
        cap = f"capped at {state['requested']}" if state["requested"] else "not capped"
        line = f"oneDNN {cap} ({available}; {kernel})"
    if state["amx_used"]:
        line += ": bf16 rows may depend on the batch"
        if state.get("allow_variant_bf16"):
            line += f" (accepted by {WAIVER_VARIABLE}=1)"
    return line


class CpuIsaError(RuntimeError):
    """oneDNN's kernels would make bf16 rows depend on the batch (the message says why and the fix)."""


def check_cpu_isa() -> str:
    """The effective oneDNN ISA in one line (`describe`); CpuIsaError when oneDNN uses AMX bf16 kernels,
    unless DEEPINFER_ALLOW_VARIANT_BF16=1 waives it. (Where oneDNN's verbose output cannot be read, the
    line says so, and only the start self-test decides.)

    For engines in batch_invariant mode on CPU with dtype bfloat16. The first call runs one small bf16
    matmul (milliseconds); later calls reuse what it found.
    """
    state = onednn_state()
    problem = isa_problem(state)
    if problem is not None and not state["allow_variant_bf16"]:
        raise CpuIsaError(problem)
    return state["summary"]
