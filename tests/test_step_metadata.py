"""Fixed-capacity step metadata (deepinfer/model/batch.py).

- a step's tensors have shapes that depend only on its buckets, and the forward computes cache
  addresses from them without reading a value back (it runs on meta tensors, whose values are
  unknowable) and without a shape that follows the data;
- padding is inert: more padding tokens, sequence rows and block-table columns leave every real
  row's hidden state and every cache row outside the null block bit for bit unchanged;
- the close capacity covers every window a step can close;
- on CUDA, a decode step captured as a CUDA graph replays other steps of its bucket bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer import kernels
from deepinfer import LLM, SamplingParams, transfer
from deepinfer.families.v4.model import DeepseekV4
from deepinfer.model import NULL_BLOCK, StepBatch, bucket
from deepinfer.model.batch import close_capacity, graph_bucket

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPTS = [list(range(2, 12)), list(range(40, 77)), list(range(100, 105))]


@given(st.integers(0, 10_000))
def test_buckets_cover_and_are_fixed_points(n):
    size = bucket(n)
    assert size >= max(n, 1) and bucket(size) == size
    assert size - n < 8 if n > 8 else size < 2 * max(n, 1)
    wide = graph_bucket(n)  # graphed steps' table widths: powers of two, so few shapes as tables grow
    assert wide >= size and wide & (wide - 1) == 0 and wide < 2 * max(n, 1)


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 64)), min_size=1, max_size=12),
       st.integers(1, 20))
def test_close_capacity_covers_every_closing_window(chunks, ratio):
    closing = sum(sum((p + 1) % ratio == 0 for p in range(start, start + n)) for start, n in chunks)
    assert closing <= close_capacity(sum(n for _, n in chunks), len(chunks), ratio)


def mid_run(device: str = "cpu", dtype: str = "float32", steps: int = 2,
            numerics: str = "batch_invariant") -> tuple[LLM, object]:
    """An engine a few steps into three requests (chunked prefill next to decodes), and its next step
    (scheduled by the test, so the engine reads each step's results before the next)."""
    llm = LLM("preset:tiny", device=device, dtype=dtype, max_model_len=256, max_num_batched_tokens=24,
              numerics=numerics, async_scheduling=False)
    for prompt in PROMPTS:
        llm.add_request(prompt, PARAMS)
    for _ in range(steps):
        llm.step()
    return llm, llm.scheduler.schedule()


def test_step_shapes_are_the_buckets_of_the_step():
    llm, scheduled = mid_run()
    batch, _ = llm.runner.build_batch(scheduled.chunks)
    tokens = sum(chunk.num_tokens for chunk in scheduled.chunks)
    assert batch.shapes()["input_ids"] == (bucket(tokens),)
    assert batch.shapes()["query_start"] == (bucket(len(scheduled.chunks)) + 1,)
    for pool, table in batch.block_tables.items():
        longest = max(len(chunk.seq.blocks.table(pool)) for chunk in scheduled.chunks)
        assert table.shape == (bucket(len(scheduled.chunks)), bucket(longest))
    llm.scheduler.update(scheduled, llm.runner.execute(scheduled).result(scheduled))
    for _ in range(2):
        llm.step()
    decode = llm.scheduler.schedule().chunks
    assert len(decode) == 3 and all(chunk.num_tokens == 1 and chunk.samples for chunk in decode)
    # decode steps of 3 and 4 sequences (another bucket-4 step) have the same shapes
    three, _ = llm.runner.build_batch(decode)
    four, _ = llm.runner.build_batch(decode + decode[:1])
    assert three.shapes() == four.shapes()


def repad(batch: StepBatch, tokens: int, rows: int, columns: int) -> StepBatch:
    """`batch` with `tokens` more padding tokens, `rows` more sequence rows and `columns` more
    block-table columns (all padding)."""
    real = int(batch.query_start[-1])
    table_pad = {pool: torch.nn.functional.pad(t, (0, columns, 0, rows), value=NULL_BLOCK)
                 for pool, t in batch.block_tables.items()}
    return StepBatch(
        input_ids=torch.nn.functional.pad(batch.input_ids, (0, tokens)),
        positions=torch.nn.functional.pad(batch.positions, (0, tokens)),
        query_start=torch.nn.functional.pad(batch.query_start, (0, rows), value=real),
        block_tables=table_pad, block_size=batch.block_size, sample_index=None,
    )


@pytest.mark.parametrize("numerics", ["batch_invariant", "fast"])
def test_padding_changes_no_real_row_and_writes_only_the_null_block(numerics):
    llm, scheduled = mid_run(numerics=numerics)
    batch, _ = llm.runner.build_batch(scheduled.chunks)
    batch.sample_index = None
    real = int(batch.query_start[-1])
    assert any(chunk.num_tokens > 1 for chunk in scheduled.chunks) and len(scheduled.chunks) > 1
    before = {name: pool.clone() for name, pool in llm.cache.storage.items()}
    plain = llm.model(batch, llm.cache.layer_views)[:real]
    written = {name: pool.clone() for name, pool in llm.cache.storage.items()}
    for name, pool in llm.cache.storage.items():
        pool.copy_(before[name])
    padded = llm.model(repad(batch, tokens=13, rows=5, columns=3), llm.cache.layer_views)[:real]
    null = slice(NULL_BLOCK * batch.block_size, (NULL_BLOCK + 1) * batch.block_size)
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # fast: a taller batch may sum differently
        return torch.equal(a, b) if numerics == "batch_invariant" else torch.allclose(a, b, rtol=1e-4, atol=1e-5)

    changed = set()
    for name, pool in llm.cache.storage.items():
        outside = torch.ones(pool.shape[1], dtype=torch.bool)
        outside[null] = False
        assert same(pool[:, outside], written[name][:, outside]), name
        if not torch.equal(pool[:, outside], before[name][:, outside]):
            changed.add(name)
    assert {"window", "csa_state", "csa_entries", "hca_state"} <= changed  # the step wrote, and closed CSA windows
    assert same(padded, plain)


def test_the_forward_reads_no_value_back_and_follows_only_shapes():
    """The whole forward on meta tensors: any host read of a value, or a shape taken from one (a
    boolean mask, `nonzero`), fails there. The CPU experts' loop reads its group sizes on the host
    (free on CPU; CUDA's grouped kernel does not, tests/test_step_contract.py), so it is replaced
    by a shape-keeping stand-in here."""
    llm, scheduled = mid_run()
    host, _ = llm.runner.build_batch(scheduled.chunks)
    ops = llm.model.ops
    table = {name: getattr(ops, name) for name in kernels.OPS}
    table["moe_experts"] = lambda x, *args, **kwargs: x
    meta_ops = kernels.Ops(ops.numerics, "cpu", table)
    model = DeepseekV4(llm.model.config, meta_ops, device="meta")
    model.main_rope.to("meta")
    model.compress_rope.to("meta")
    views = [{kind: torch.empty_like(view, device="meta") for kind, view in layer.items()}
             for layer in llm.cache.layer_views]
    meta = StepBatch(
        input_ids=host.input_ids.to("meta"), positions=host.positions.to("meta"),
        query_start=host.query_start.to("meta"),
        block_tables={pool: t.to("meta") for pool, t in host.block_tables.items()},
        block_size=host.block_size, sample_index=host.sample_index.to("meta"),
    )
    hidden = model(meta, views)
    assert hidden.shape == (host.sample_index.shape[0], llm.model.config.hidden_size)
    assert hidden.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_decode_step_replays_other_steps_of_its_bucket():
    from deepinfer.engine.graph import StepGraph

    llm, scheduled = mid_run("cuda", "bfloat16", steps=6)
    assert all(chunk.num_tokens == 1 for chunk in scheduled.chunks)
    storage = llm.cache.storage

    def snapshot() -> dict[str, torch.Tensor]:
        return {name: pool.clone() for name, pool in storage.items()}

    def restore(saved: dict[str, torch.Tensor]) -> None:
        for name, pool in storage.items():
            pool.copy_(saved[name])

    def outside_null(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        null = slice(NULL_BLOCK * llm.cache.block_size, (NULL_BLOCK + 1) * llm.cache.block_size)
        cleared = {name: pool.clone() for name, pool in saved.items()}
        for pool in cleared.values():
            pool[:, null] = 0
        return cleared

    saved = snapshot()
    graph = StepGraph(llm.model, llm.cache.layer_views, llm.runner.build_batch(scheduled.chunks)[0].to(llm.runner.device)[0])
    restore(saved)
    for step in range(4):
        if step:
            llm.scheduler.update(scheduled, llm.runner.execute(scheduled).result(scheduled))
            scheduled = llm.scheduler.schedule()
        batch, _ = llm.runner.build_batch(scheduled.chunks)[0].to(llm.runner.device)
        assert graph.fits(batch), f"step {step} left the captured bucket: {batch.shapes()}"
        saved = snapshot()
        eager = llm.model(batch, llm.cache.layer_views).clone()
        wrote = outside_null(snapshot())
        restore(saved)
        assert torch.equal(graph.replay(batch), eager), f"step {step}"
        replayed = outside_null(storage)
        assert all(torch.equal(replayed[name], wrote[name]) for name in storage), f"step {step}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny", "v41-tiny"])
def test_engine_graphs_serve_the_bits_of_eager_steps(preset):
    """`EngineConfig.cuda_graphs`: decode steps replayed from graphs captured per step shape give the tokens
    and logprobs of eager steps, while requests arrive and finish (batch buckets 1 to 4, growing tables)."""
    from dataclasses import replace

    from deepinfer import EngineConfig

    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, max_num_batched_tokens=24)
    eager = LLM(f"preset:{preset}", replace(config, cuda_graphs=False))
    graphed = eager.with_engine(config)
    assert eager.runner.graphs is None and graphed.runner.graphs == {}
    prompts = [[2 + i for i in range(n)] for n in (10, 37, 5, 21)]
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (40, 12, 60, 25)]

    def run(llm: LLM) -> list:
        for prompt, params in zip(prompts[:2], lengths[:2]):
            llm.add_request(prompt, params)
        for _ in range(8):
            llm.step()
        for prompt, params in zip(prompts[2:], lengths[2:]):
            llm.add_request(prompt, params)
        outputs = []
        while llm.has_unfinished():
            outputs += llm.step()
        return sorted((o.request_id, o.token_ids, o.logprobs, o.top_logprobs) for o in outputs)

    assert run(graphed) == run(eager)
    assert len(graphed.runner.graphs) >= 4  # several shapes were captured and replayed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny", "v41-tiny"])
def test_fast_numerics_decode_steps_replay_graphs(preset):
    """Fast numerics reads nothing on the host in a step (`kernels/fast_cuda.py`), so its decode steps are
    captured and replayed too (its bits are not promised, graphed or not)."""
    from deepinfer import EngineConfig

    llm = LLM(f"preset:{preset}", EngineConfig(device="cuda", dtype="bfloat16", numerics="fast", max_model_len=256))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([[2 + i for i in range(n)] for n in (10, 37)], params)
    assert llm.runner.graphs and [len(o.token_ids) for o in outputs] == [12, 12]


@given(seed=st.integers(0, 2**31), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5))
def test_packed_step_tensors_travel_bit_for_bit(seed, sizes):
    """The one-copy transfer packs every dtype a step sends (Engram memory in bf16 included) through
    int64 bit patterns: NaN payloads, -0.0 and subnormals arrive unchanged."""
    g = torch.Generator().manual_seed(seed)
    makers = (lambda n: torch.randint(-2**62, 2**62, (n,), generator=g),
              lambda n: torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32),
              lambda n: torch.randint(0, 2, (n,), generator=g, dtype=torch.bool),
              lambda n: torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32),
              lambda n: torch.randint(-2**15, 2**15 - 1, (n,), generator=g, dtype=torch.int16).view(torch.bfloat16))
    tensors = [makers[i % len(makers)](n) for i, n in enumerate(sizes)]
    back = transfer._unpack(transfer._pack(tensors), tensors)
    for sent, got in zip(tensors, back):
        assert got.dtype == sent.dtype and torch.equal(got.view(torch.uint8), sent.view(torch.uint8))
