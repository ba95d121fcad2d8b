"""kernels/selftest.py: the start self-test of the batch-invariant CPU primitives passes on this CPU,
refuses in one line a table whose primitive is made to depend on the batch (by itself and through
LLM), can be waived, and what ran is recorded in manifests and stated in certificates."""

from __future__ import annotations

import pytest
import torch

import kernels
from audit.certificate import cpu_isa_statement
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from harness.environment import environment_fingerprint
from kernels import invariant, selftest
from kernels.cpu_isa import cpu_threads

WAIVER_HINT = "; set DEEPINFER_ALLOW_VARIANT_CPU=1 to run anyway (recorded in manifests)"


@pytest.fixture(autouse=True)
def own_results(monkeypatch):
    """Each test's self-tests are its own: a deliberately variant table must not reach later manifests."""
    monkeypatch.setattr(selftest, "_results", {})
    monkeypatch.delenv(selftest.WAIVER_VARIABLE, raising=False)


def _variant(**primitives) -> kernels.Ops:
    table = {name: getattr(invariant, name) for name in kernels._PRIMITIVES}
    table.update(primitives)
    return kernels.Ops("batch_invariant", "cpu", kernels._complete(table))


def _by_row_count(op):
    """`op` whose result moves by one part in 2^20 with the parity of the batch's row count."""
    def variant(x, *args, **kwargs):
        out = op(x, *args, **kwargs)
        return out * (1 + (x.shape[0] % 2) * 2.0 ** -20)
    return variant


VARIANTS = {
    "linear": lambda: _variant(linear=_by_row_count(invariant.linear)),
    "sink_attention": lambda: _variant(sink_attention=_by_row_count(invariant.sink_attention)),
    "rms_norm": lambda: _variant(rms_norm=_by_row_count(invariant.rms_norm)),
}


def _refusal(name: str, dtype: str) -> str:
    key = f"{dtype}, {torch.get_num_threads()} threads"
    return (f"batch-invariant {name} ({key}) gives rows that depend on the batch on this CPU "
            f"({selftest.library_path()}){WAIVER_HINT}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_primitives_pass_on_this_cpu(dtype, threads):
    with cpu_threads(threads):
        record = selftest.check_cpu_invariance(kernels.bind("batch_invariant", "cpu"), dtype)
    assert (record["passed"], record["variant"], record["waived"]) == (True, [], False)
    assert record["path"] == selftest.library_path()


@pytest.mark.parametrize("primitive", list(VARIANTS))
def test_a_primitive_made_batch_variant_is_refused_in_one_line(primitive):
    with pytest.raises(selftest.CpuInvarianceError) as refused:
        selftest.check_cpu_invariance(VARIANTS[primitive](), torch.float32)
    assert str(refused.value) == _refusal(primitive, "float32")


def test_fast_numerics_would_fail_the_self_test_where_the_library_varies():
    """The fast table is what the discipline protects against: the self-test sees what it does."""
    failed = selftest.variant_primitives(kernels.bind("fast", "cpu"), torch.float32)
    assert set(failed) <= {"linear", "clamped_swiglu", "sink_attention",
                           "indexer_scores", "mix_streams"}


def test_an_engine_on_a_variant_table_refuses_to_start(monkeypatch):
    monkeypatch.setattr(kernels, "bind", lambda numerics, device: VARIANTS["linear"]())
    with pytest.raises(DeepInferError) as refused:
        LLM("preset:tiny", max_model_len=64)
    assert str(refused.value) == _refusal("linear", "float32") and "\n" not in str(refused.value)


def test_the_waiver_runs_anyway_and_the_manifest_and_certificate_say_so(monkeypatch):
    monkeypatch.setattr(kernels, "bind", lambda numerics, device: VARIANTS["linear"]())
    monkeypatch.setenv(selftest.WAIVER_VARIABLE, "1")
    LLM("preset:tiny", max_model_len=64)
    environment = environment_fingerprint()
    key = f"float32, {torch.get_num_threads()} threads"
    record = environment["torch_cpu"]["selftest"][key]
    assert (record["passed"], record["variant"], record["waived"]) == (False, ["linear"], True)
    statement = cpu_isa_statement({"environment": environment})
    assert statement.endswith(f"; self-test FAILED ({key}: linear depend on the batch, waived by "
                              "DEEPINFER_ALLOW_VARIANT_CPU=1)")
    assert statement.startswith(f"CPU: {environment['cpu']} ({environment['cpu_vendor']}); MKL for ")


def test_manifests_record_the_cpu_and_its_library_paths():
    LLM("preset:tiny", max_model_len=64)
    environment = environment_fingerprint()
    cpu = environment["torch_cpu"]
    assert environment["cpu_vendor"] in ("GenuineIntel", "AuthenticAMD") and environment["cpu"]
    assert "sse2" in environment["cpu_flags"] and environment["cpu_flags"] == sorted(environment["cpu_flags"])
    assert cpu["mkl"]["path"] and cpu["mkl"]["cnr"] and cpu["onednn"]["fp32_matmul"]
    key = f"float32, {torch.get_num_threads()} threads"
    assert cpu["selftest"][key]["passed"]
    statement = cpu_isa_statement({"environment": environment})
    assert statement == (f"CPU: {environment['cpu']} ({environment['cpu_vendor']}); MKL for {cpu['mkl']['path']}, "
                         f"CNR:{cpu['mkl']['cnr']}; {cpu['onednn']['summary']}; self-test passed ({key})")


def test_every_library_call_of_a_weight_has_one_shape(monkeypatch):
    """The discipline itself, whatever the library does: the calls a weight makes, and the batched
    attention products, have one shape (and one memory layout) for any batch."""
    shapes = set()
    library = invariant._library_linear
    monkeypatch.setattr(invariant, "_library_linear", lambda rows, w: shapes.add((rows.shape, w.shape)) or library(rows, w))
    linear = torch.nn.functional.linear
    monkeypatch.setattr(invariant.F, "linear", lambda rows, w: shapes.add((rows.shape, w.shape)) or linear(rows, w))
    bmm = torch.bmm
    monkeypatch.setattr(invariant.torch, "bmm", lambda a, b: shapes.add((a.shape, b.shape, a.stride(), b.stride()))
                        or bmm(a, b))
    for dtype in (torch.float32, torch.bfloat16):
        width = 2 * invariant.K_BLOCK + 100
        weight = invariant.matmul_layout(torch.randn(64, width).to(dtype))
        shapes.clear()
        for rows in (1, 5, 32, 33, 600):
            invariant.linear(torch.randn(rows, width).to(dtype), weight)
        calls = {torch.float32: 2, torch.bfloat16: 1}[dtype]  # fp32: the full K blocks, and the rest
        assert len(shapes) == calls, shapes
    shapes.clear()
    for tokens, keys in ((1, 3), (1, 64), (7, 65), (40, 300)):
        q, kv = torch.randn(tokens, 4, 32), torch.randn(tokens, keys, 32)
        invariant.sink_attention(q, kv, torch.ones(tokens, keys, dtype=torch.bool), torch.zeros(4), 0.1)
    assert {(a[0], b[0]) for a, b, _, _ in shapes} == {(invariant.MATRIX_BATCH, invariant.MATRIX_BATCH)}
    assert len(shapes) == 2, shapes  # scores and values: one shape and one layout each (MKL's kernels differ by both)
