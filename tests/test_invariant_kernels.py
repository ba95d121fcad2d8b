"""The CPU batch-invariant kernels, op by op: a row's bits do not depend on the rows around it, on
how wide the batch's key lists are, or on the thread count. (tests/test_invariance.py checks the
same through the whole engine; this pins down which op breaks if it ever does.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpu_paths import bf16_refusal
from deepinfer.kernels.cpu_isa import cpu_threads
from deepinfer.kernels import fast, invariant

# (out_features, in_features) of the tiny and small presets' matmuls, incl. the hyper-connection
# projections (K = hc_mult * hidden) and the router (few outputs)
LINEAR_SHAPES = [(8192, 512), (512, 512), (1024, 256), (512, 256), (24, 2048), (4, 2048), (16, 512), (128, 64),
                 (1024, 128)]


THREAD_COUNTS = sorted({1, 2, torch.get_num_threads()})


def _weight(shape, dtype, column_major):
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0] * 7 + shape[1])).to(dtype)
    return invariant.matmul_layout(weight) if column_major else weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_rows_do_not_depend_on_the_batch_or_thread_count(shape, dtype):
    if dtype == torch.bfloat16 and (refusal := bf16_refusal()):
        pytest.skip(f"the engine refuses bf16 on this CPU code path: {refusal}")
    weight = _weight(shape, dtype, column_major=True)
    x = torch.randn(600, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    with cpu_threads(1):
        alone = torch.cat([invariant.linear(x[i:i + 1], weight) for i in range(0, 600, 23)])
    for n_threads in THREAD_COUNTS:
        with cpu_threads(n_threads):
            full = invariant.linear(x, weight)
            assert torch.equal(full[::23], alone)
            for rows in (2, 3, 17, 255, 256, 257, 513):
                assert torch.equal(invariant.linear(x[:rows], weight), full[:rows]), (n_threads, rows)
    reference = x.double() @ weight.double().T
    assert torch.allclose(full.double(), reference, rtol=0, atol=1e-3 if dtype == torch.float32 else 0.5)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 700), row=st.data(), n_threads=st.sampled_from(THREAD_COUNTS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_linear_row_alone_equals_row_in_any_batch(rows, row, n_threads, dtype):
    weight = _weight((512, 512), dtype, column_major=True)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    i = row.draw(st.integers(0, rows - 1))
    with cpu_threads(n_threads):
        batched = invariant.linear(x, weight)
    with cpu_threads(1):
        assert torch.equal(batched[i], invariant.linear(x[i], weight))


def test_matmul_layout_keeps_values_and_linear_accepts_either_layout():
    weight = torch.randn(64, 96)
    stored = invariant.matmul_layout(weight)
    assert torch.equal(stored, weight) and stored.stride() == (1, 64)
    assert invariant.matmul_layout(stored) is stored
    stacked = invariant.matmul_layout(torch.randn(3, 64, 96))
    assert stacked[1].stride() == (1, 64)
    assert fast.matmul_layout(weight) is weight
    assert invariant.matmul_layout(weight.bfloat16()).stride() == (96, 1)  # bf16 runs as stored
    x = torch.randn(5, 96)
    assert torch.equal(invariant.linear(x, weight), invariant.linear(x, stored))


def _attention_case(heads, dim, dtype, tokens=24, max_keys=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    lengths = torch.randint(1, max_keys, (tokens,), generator=gen)
    width = int(lengths.max())
    keys = torch.randn(tokens, width, dim, generator=gen).to(dtype)
    valid = (torch.arange(width) < lengths[:, None]) & (torch.rand(tokens, width, generator=gen) > 0.1)
    return q, keys, valid, lengths


def _own_keys(keys, valid, lengths, extra):
    """The same tokens as a batch whose longest key list is `extra` keys longer (invalid filler)."""
    width = int(lengths.max()) + extra
    filler = torch.randn(keys.shape[0], width - keys.shape[1], keys.shape[2]).to(keys.dtype)
    return (torch.cat([keys, filler], dim=1),
            torch.cat([valid, torch.zeros(valid.shape[0], width - valid.shape[1], dtype=torch.bool)], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(8, 128), (4, 64), (16, 64)])
def test_attention_and_indexer_rows_do_not_depend_on_the_batch(heads, dim, dtype):
    q, keys, valid, lengths = _attention_case(heads, dim, dtype)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(2))
    head_weights = torch.rand(q.shape[0], heads, generator=torch.Generator().manual_seed(3))
    with cpu_threads(1):
        attn = invariant.sink_attention(q, keys, valid, sinks, 0.1)
        scores = invariant.indexer_scores(q, keys, head_weights, valid, 0.1)
    expected = fast.sink_attention(q.float(), keys.float(), valid, sinks, 0.1)
    assert torch.allclose(attn.float(), expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    for n_threads in THREAD_COUNTS:
        for extra in (0, 3, 64, 130):
            for tokens in (slice(0, 1), slice(5, 6), slice(2, 9), slice(0, None)):
                own = lengths[tokens]
                sub_keys, sub_valid = _own_keys(keys[tokens][:, :int(own.max())], valid[tokens][:, :int(own.max())],
                                                own, extra)
                with cpu_threads(n_threads):
                    assert torch.equal(invariant.sink_attention(q[tokens], sub_keys, sub_valid, sinks, 0.1),
                                       attn[tokens]), (n_threads, extra, tokens)
                    sub_scores = invariant.indexer_scores(q[tokens], sub_keys, head_weights[tokens], sub_valid, 0.1)
                width = int(own.max())
                assert torch.equal(sub_scores[:, :width], scores[tokens][:, :width])
                assert bool((sub_scores[:, width:] == float("-inf")).all())


def test_attention_with_fewer_keys_than_min_keys():
    q, keys, valid, _ = _attention_case(8, 128, torch.float32, max_keys=3)
    sinks = torch.zeros(8)
    out = invariant.sink_attention(q, keys, valid, sinks, 0.1)
    padded = torch.cat([keys, torch.zeros(keys.shape[0], 20, 128)], dim=1)
    padded_valid = torch.cat([valid, torch.zeros(valid.shape[0], 20, dtype=torch.bool)], dim=1)
    assert torch.equal(out, invariant.sink_attention(q, padded, padded_valid, sinks, 0.1))
    assert torch.allclose(out, fast.sink_attention(q, keys, valid, sinks, 0.1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fn", [torch.exp, torch.sigmoid, torch.nn.functional.silu, torch.nn.functional.softplus])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_bits_do_not_depend_on_where_an_element_sits(fn, dtype):
    values = torch.randn(40_000, generator=torch.Generator().manual_seed(4)).to(dtype)
    whole = invariant.pointwise(fn, values)
    alone = torch.cat([invariant.pointwise(fn, values[i:i + 1]) for i in range(0, 40_000, 20)])
    assert torch.equal(alone, whole[::20])  # alone, a plain call takes the scalar path (silu: 3 % differ)
    for start, stop in ((0, 1), (7, 8), (3, 70), (100, 16_500), (39_990, 40_000)):
        assert torch.equal(invariant.pointwise(fn, values[start:stop]), whole[start:stop]), (start, stop)
    assert torch.equal(invariant.pointwise(fn, values.view(200, 200)[:, 3]), whole.view(200, 200)[:, 3])


def test_mix_streams_and_window_pool_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(5)
    comb, streams = torch.rand(300, 4, 4, generator=gen), torch.randn(300, 4, 512, generator=gen)
    kv, gate, bias = torch.randn(300, 4, 512, generator=gen), torch.randn(300, 4, 512, generator=gen), torch.randn(4, 512)
    gate[torch.rand(300, 4, 512, generator=gen) < 0.2] = float("-inf")
    gate[:, 0] = 0.0  # a window always has a slot (all -inf would be NaN, never equal to itself)
    for n_threads in THREAD_COUNTS:
        with cpu_threads(n_threads):
            mixed = invariant.mix_streams(comb, streams)
            pooled = invariant.window_pool(kv, gate, bias)
            for i in (0, 17, 299):
                assert torch.equal(invariant.mix_streams(comb[i:i + 1], streams[i:i + 1])[0], mixed[i])
                assert torch.equal(invariant.window_pool(kv[i:i + 1], gate[i:i + 1], bias)[0], pooled[i])


def test_the_model_loads_every_matmul_weight_in_matmul_layout(tiny_checkpoint, monkeypatch):
    """A weight missing from a module's MATMUL_WEIGHTS would still be right, but copied on every call."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(tiny_checkpoint)
    converted = []
    layout = invariant.matmul_layout

    def spy(weight):
        stored = layout(weight)
        if stored is not weight:
            converted.append(tuple(weight.shape))
        return stored

    monkeypatch.setattr(invariant, "matmul_layout", spy)
    llm.generate([list(range(2, 120))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert converted == []
