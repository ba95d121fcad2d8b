"""kernels/selftest.py: the start self-test of the batch-invariant CPU primitives passes on this CPU,
refuses in one line a table whose primitive is made to depend on the batch (by itself and through
LLM), can be waived, and what ran is recorded in manifests and stated in certificates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer import kernels
from deepinfer.audit.certificate import cpu_isa_statement
from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.harness.environment import environment_fingerprint
from deepinfer.kernels import invariant, selftest
from deepinfer.kernels.cpu_isa import cpu_threads

WAIVER_HINT = "; set DEEPINFER_ALLOW_VARIANT_CPU=1 to run anyway (recorded in manifests)"


@pytest.fixture(autouse=True)
def own_results(monkeypatch):
    """Each test's self-tests are its own: a deliberately variant table must not reach later manifests."""
    monkeypatch.setattr(selftest, "_results", {})
    monkeypatch.setattr(selftest, "_proven", {})
    monkeypatch.setattr(invariant, "_libraries", {})
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
    monkeypatch.setattr(kernels, "bind", lambda numerics, device, row_tiles=None: VARIANTS["linear"]())
    with pytest.raises(DeepInferError) as refused:
        LLM("preset:tiny", max_model_len=64)
    assert str(refused.value) == _refusal("linear", "float32") and "\n" not in str(refused.value)


def test_the_waiver_runs_anyway_and_the_manifest_and_certificate_say_so(monkeypatch):
    monkeypatch.setattr(kernels, "bind", lambda numerics, device, row_tiles=None: VARIANTS["linear"]())
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
    tiles = selftest.proven_row_tiles((torch.float32,)).candidates[torch.float32]
    assert cpu["selftest"][key]["row_tiles"] == list(tiles) and invariant.ROW_TILE in tiles
    by_shape = cpu["selftest"][key]["row_tiles_by_shape"]
    assert by_shape and all(plan["library"] in ("mkl", "onednn") and invariant.ROW_TILE in plan["tiles"]
                            and (plan["library"] == "mkl" or set(plan["tiles"]) <= set(tiles)) for plan in by_shape.values())
    statement = cpu_isa_statement({"environment": environment})
    assert statement == (f"CPU: {environment['cpu']} ({environment['cpu_vendor']}); MKL for {cpu['mkl']['path']}, "
                         f"CNR:{cpu['mkl']['cnr']}; {cpu['onednn']['summary']}; self-test passed "
                         f"({key}; row tiles {', '.join(map(str, tiles))})")


def test_every_library_call_of_a_weight_has_one_shape_per_row_tile(monkeypatch):
    """The discipline itself, whatever the library does: the calls a weight makes have one shape (and
    one memory layout) per row tile for any batch, one shape in all with ROW_TILE alone; the batched
    attention products have one shape each."""
    shapes = set()
    onednn = invariant._onednn_linear
    monkeypatch.setattr(invariant, "_onednn_linear", lambda rows, w: shapes.add((rows.shape, w.shape)) or onednn(rows, w))
    linear = torch.nn.functional.linear
    monkeypatch.setattr(invariant.F, "linear", lambda rows, w: shapes.add((rows.shape, w.shape)) or linear(rows, w))
    bmm = torch.bmm
    monkeypatch.setattr(invariant.torch, "bmm", lambda a, b: shapes.add((a.shape, b.shape, a.stride(), b.stride()))
                        or bmm(a, b))
    ladder = invariant.RowTiles({torch.float32: invariant.ROW_TILES, torch.bfloat16: invariant.ROW_TILES})
    for dtype in (torch.float32, torch.bfloat16):
        width = 2 * invariant.K_BLOCK + 100
        weight = invariant.matmul_layout(torch.randn(64, width).to(dtype))
        calls = {torch.float32: 2, torch.bfloat16: 1}[dtype]  # fp32: the full K blocks, and the rest
        shapes.clear()
        for rows in (1, 5, 32, 33, 600):
            invariant.linear(torch.randn(rows, width).to(dtype), weight)
        assert len(shapes) == calls and {shape[0][0] for shape in shapes} == {invariant.ROW_TILE}, shapes
        library, tiles = ladder.plan(weight)  # proven on the weight at its first call
        assert library == invariant.library_for(weight)
        for rows in (1, 5, 32, 33, 600):
            shapes.clear()
            invariant.linear(torch.randn(rows, width).to(dtype), weight, row_tiles=ladder)
            cut = set(invariant.cut_rows(rows, tiles, invariant.call_cost_rows(weight)))
            assert {shape[0][0] for shape in shapes} == cut and len(shapes) == calls * len(cut), shapes
    shapes.clear()
    for tokens, keys in ((1, 3), (1, 64), (7, 65), (40, 300)):
        q, kv = torch.randn(tokens, 4, 32), torch.randn(tokens, keys, 32)
        invariant.sink_attention(q, kv, torch.ones(tokens, keys, dtype=torch.bool), torch.zeros(4), 0.1)
    assert {(a[0], b[0]) for a, b, _, _ in shapes} == {(invariant.MATRIX_BATCH, invariant.MATRIX_BATCH)}
    assert len(shapes) == 2, shapes  # scores and values: one shape and one layout each (MKL's kernels differ by both)


@given(st.integers(0, 3000), st.sets(st.sampled_from(invariant.ROW_TILES), min_size=1), st.integers(0, 400))
def test_rows_are_cut_into_whole_tiles_of_the_allowed_sizes(n, allowed, call_cost):
    tiles = tuple(sorted(allowed))
    cut = invariant.cut_rows(n, tiles, call_cost)
    assert set(cut) <= allowed and list(cut) == sorted(cut, reverse=True)
    assert cut.count(max(tiles)) >= n // max(tiles) and n <= sum(cut) < max(n, 1) + max(tiles)
    if len(tiles) == 1:  # one tile: the rows padded to the fewest whole tiles
        assert cut == (tiles[0],) * max(1, -(-n // tiles[0]))
    assert len(invariant.cut_rows(n, tiles, call_cost + 50)) <= len(cut)  # dearer calls: never more of them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_proven_row_tiles_give_every_row_the_bits_of_one_row_tile(dtype):
    """What engines serve with: whatever cut a batch gets, each row has the bits of ROW_TILE calls."""
    row_tiles = selftest.proven_row_tiles((dtype,))
    assert invariant.ROW_TILE in row_tiles.candidates[dtype]
    if dtype != torch.float32:  # bf16's rounding hides order differences from a proof: one tile
        assert row_tiles.candidates[dtype] == (invariant.ROW_TILE,)
    gen = torch.Generator().manual_seed(3)
    weight = invariant.matmul_layout(torch.randn(200, invariant.K_BLOCK + 40, generator=gen).to(dtype))
    x = torch.randn(300, invariant.K_BLOCK + 40, generator=gen).to(dtype)
    canonical = invariant.linear(x, weight)
    for start, stop in ((0, 1), (7, 9), (3, 40), (10, 300), (0, 257)):
        assert torch.equal(invariant.linear(x[start:stop], weight, row_tiles=row_tiles), canonical[start:stop]), (start, stop)


def test_a_row_tile_that_changes_the_bits_is_not_proven_and_engines_do_not_cut_into_it(monkeypatch):
    tile_linear = invariant._tile_linear
    monkeypatch.setattr(invariant, "_tile_linear",
                        lambda rows, w, library: tile_linear(rows, w, library) * (1 + (rows.shape[0] == 8) * 2.0 ** -20))
    tiles = selftest.proven_row_tiles((torch.float32,)).candidates[torch.float32]
    assert 8 not in tiles and invariant.ROW_TILE in tiles
    LLM("preset:tiny", max_model_len=64)
    key = f"float32, {torch.get_num_threads()} threads"
    record = environment_fingerprint()["torch_cpu"]["selftest"][key]
    assert record["row_tiles"] == list(tiles) and all(8 not in plan["tiles"] for plan in record["row_tiles_by_shape"].values())


def test_a_tile_that_changes_the_bits_of_one_weight_shape_only_is_not_used_for_it(monkeypatch):
    """What the probe weights cannot see (on a Xeon, oneDNN's AVX2 code passed them with tiles that
    changed a tiny model's bits): each weight proves the tiles again on its first call."""
    tile_linear = invariant._tile_linear
    monkeypatch.setattr(invariant, "_tile_linear", lambda rows, w, library: tile_linear(rows, w, library) * (
        1 + (rows.shape[0] == 2 and w.shape[0] == 40) * 2.0 ** -20))
    row_tiles = selftest.proven_row_tiles((torch.float32,))
    assert 2 in row_tiles.candidates[torch.float32]
    gen = torch.Generator().manual_seed(5)
    width = invariant.MKL_WEIGHT // 40 + 1  # oneDNN's weights (the probes prove its tiles)
    odd, usual = (invariant.matmul_layout(torch.randn(n, width, generator=gen)) for n in (40, 41))
    assert 2 not in row_tiles.plan(odd)[1] and 2 in row_tiles.plan(usual)[1]
    x = torch.randn(30, width, generator=gen)
    for weight in (odd, usual):
        canonical = invariant.linear(x, weight)
        assert all(torch.equal(invariant.linear(x[i:i + 1], weight, row_tiles=row_tiles), canonical[i:i + 1]) for i in range(30))


@pytest.mark.parametrize("isa_kernels", [False, True], ids=["mkl-generic", "mkl-isa"])
def test_weights_are_multiplied_by_mkl_only_where_its_calls_are_proven_on_them(monkeypatch, isa_kernels):
    """MKL's calls cost a small weight far less than oneDNN's (and any weight, where MKL runs an
    instruction set's kernels: Intel), but its generic code on AMD gave rows of a 6-column router weight
    other bits at other places in the tile: a weight whose MKL calls do that (here made so) is multiplied
    by oneDNN, one whose calls agree by MKL where MKL is preferred for it, and either way a row has the bits
    of its library's ROW_TILE calls however the batch is cut. Both MKL code paths' rules run on any CPU."""
    mkl = invariant._mkl_linear
    monkeypatch.setattr(invariant, "_mkl_linear", lambda rows, w: mkl(rows, w) * (
        1 + (w.shape[0] in (40, 56)) * torch.linspace(0, 2.0 ** -20, rows.shape[0])[:, None]))
    monkeypatch.setattr(invariant, "mkl_isa_kernels", lambda: isa_kernels)
    monkeypatch.setattr(invariant, "_libraries", {})
    monkeypatch.setattr(invariant.CANONICAL, "by_shape", {})  # plans made under the other rule's library
    row_tiles = invariant.RowTiles(selftest.proven_row_tiles((torch.float32,)).candidates)  # no plans from before
    gen = torch.Generator().manual_seed(6)
    odd, usual, large, odd_large = (invariant.matmul_layout(torch.randn(n, k, generator=gen)) for n, k in (
        (40, 72), (41, 72), (48, invariant.MKL_WEIGHT // 48 + 1), (56, invariant.MKL_WEIGHT // 56 + 1)))
    assert invariant.library_for(odd) == "onednn" and invariant.library_for(odd_large) == "onednn"
    assert invariant.library_for(usual) == ("mkl" if invariant._mkl_proven(usual) else "onednn")
    assert invariant.library_for(large) == ("mkl" if isa_kernels and invariant._mkl_proven(large) else "onednn")
    for weight in (odd, usual, large, odd_large):
        library, tiles = row_tiles.plan(weight)
        assert library == invariant.library_for(weight) and invariant.ROW_TILE in tiles
        x = torch.randn(70, weight.shape[1], generator=gen)
        canonical = invariant.linear(x, weight)
        assert torch.equal(canonical, invariant._cut_linear(x, weight, (invariant.ROW_TILE,), library))
        for start, stop in ((0, 1), (5, 7), (3, 40), (0, 70)):
            assert torch.equal(invariant.linear(x[start:stop], weight, row_tiles=row_tiles), canonical[start:stop])
        with cpu_threads(1):
            assert torch.equal(invariant.linear(x, weight, row_tiles=row_tiles), canonical)
