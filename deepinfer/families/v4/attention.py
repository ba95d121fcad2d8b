"""V4 attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Every layer attends to the last `sliding_window` tokens. CSA layers add entries compressed from
overlapping windows of `2 * ratio` tokens, of which the lightning indexer keeps the top-k per
query; HCA layers add every entry compressed from non-overlapping windows of `ratio` tokens.
The compressor's per-token projections, the entries and the window KV all live in paged pools;
the layer writes the step's rows first and then reads each query's own rows back.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.families.v4.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.model.batch import CacheAddresses, CompressorAddresses, gather_bytes, query_chunks
from deepinfer.model.layers import Linear, RMSNorm, empty
from deepinfer.model.rope import RotaryTable
from deepinfer.kernels import Ops

POOL_PREFIX = {CSA: "csa", HCA: "hca"}  # pool names of each compressed layer type: {prefix}_state, {prefix}_entries


class Compressor(nn.Module):
    """Gated pooling of token projections into one entry per window (`wkv`, `wgate`, `ape`).

    With `overlap`, each token projects two series (width 2 * dim): entry w pools the first
    series over window w - 1 and the second series over window w.
    """

    def __init__(self, config: ModelConfig, ops: Ops, ratio: int, dim: int, overlap: bool, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(config.hidden_size, width, ops, dtype, device)
        self.wgate = Linear(config.hidden_size, width, ops, dtype, device)
        self.ape = empty(ratio, width, dtype=torch.float32, device=device)
        self.norm = RMSNorm(dim, config.rms_norm_eps, ops, device)

    @property
    def state_width(self) -> int:
        return 2 * self.wkv.weight.shape[0]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token state row: [kv | gate]."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def update(
        self, rows: torch.Tensor, step: CompressorAddresses, state: torch.Tensor, entries: torch.Tensor,
        rope: RotaryTable, state_cols: slice, entry_cols: slice,
    ) -> None:
        """Write the step's state rows (`project` of every token of the step), then pool every window
        the step closes into `entries` (a fixed-shape write: capacity the step does not use pools
        nothing valid into the null block)."""
        state[step.state_write, state_cols] = rows.to(state.dtype)
        pooled = self.norm(self.ops.paged_window_pool(state[:, state_cols], step.close_read, step.close_valid,
                                                      self.ape, self.dim, self.overlap))
        cos, sin = rope(step.close_position)
        entries[step.close_write, entry_cols] = self.ops.rotary(pooled, cos, sin).to(entries.dtype)


class Indexer(nn.Module):
    """Lightning indexer: scores compressed entries per query and keeps the top-k."""

    def __init__(self, config: ModelConfig, ops: Ops, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, ops, dtype, device)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, ops, dtype, device)
        self.compressor = Compressor(config, ops, config.compress_rates[CSA], self.head_dim, True, dtype, device)

    def select(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        entries: torch.Tensor, entry_slots: torch.Tensor, column: int, valid: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions (into each query's entry list) of the chosen entries, and their validity. The index
        keys are columns `column`.. of the entries pool's rows `entry_slots` [T, E]."""
        q = self.wq_b(q_residual).view(x.shape[0], self.n_heads, self.head_dim)
        q = self.ops.rotary(q, cos, sin)
        scores = self.ops.paged_indexer_scores(q, entries, entry_slots, column, self.weights_proj(x), valid,
                                               self.head_dim**-0.5, weight_scale=self.n_heads**-0.5)
        chosen = self.ops.topk_indices(scores, min(self.topk, scores.shape[-1]))
        return chosen, valid.gather(1, chosen)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, layer_type: str, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.layer_type = layer_type
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.o_groups = config.o_groups
        self.eps = config.rms_norm_eps
        h = config.hidden_size
        self.wq_a = Linear(h, config.q_lora_rank, ops, dtype, device)
        self.q_norm = RMSNorm(config.q_lora_rank, self.eps, ops, device)
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, ops, dtype, device)
        self.wkv = Linear(h, self.head_dim, ops, dtype, device)
        self.norm = RMSNorm(self.head_dim, self.eps, ops, device)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * config.o_lora_rank, ops, dtype, device)
        self.wo_b = Linear(self.o_groups * config.o_lora_rank, h, ops, dtype, device)
        self.attn_sink = empty(self.n_heads, dtype=torch.float32, device=device)
        if layer_type == CSA:
            self.compressor = Compressor(config, ops, config.compress_rates[CSA], self.head_dim, True, dtype, device)
            self.indexer = Indexer(config, ops, dtype, device)
        elif layer_type == HCA:
            self.compressor = Compressor(config, ops, config.compress_rates[HCA], self.head_dim, False, dtype, device)

    def cache_widths(self) -> dict[str, int]:
        """Row widths this layer needs in each pool (the cache manager sizes pools from these)."""
        if self.layer_type == CSA:
            return {
                "state": self.compressor.state_width + self.indexer.compressor.state_width,
                "entries": self.head_dim + self.indexer.head_dim,
            }
        if self.layer_type == HCA:
            return {"state": self.compressor.state_width, "entries": self.head_dim}
        return {}

    def forward(
        self, x: torch.Tensor, addresses: CacheAddresses, cache: dict[str, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor], compress_rope: RotaryTable,
    ) -> torch.Tensor:
        """Write the step's cache rows (window KV, compressed entries), then attend, the queries in
        row chunks whose gathered keys fit `READ_BUDGET_BYTES`."""
        q_residual, q = self.queries(x, rope)
        window = cache["window"]
        window[addresses.window_write] = addresses.everyone(self.window_kv(x, rope)).to(window.dtype)
        step = None
        if self.layer_type != SLIDING:
            step = addresses.compressors[POOL_PREFIX[self.layer_type]]
            self._compress(x, addresses, step, cache, compress_rope)
        parts = [self._attend(rows, q, x, q_residual, rope, addresses, step, cache)
                 for rows in query_chunks(x.shape[0], self._row_bytes(addresses, step))]
        return self.project_out(parts[0] if len(parts) == 1 else torch.cat(parts), rope)

    def queries(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the query latent `q_norm(wq_a(x))` [T, q_lora_rank], the normed, RoPE'd queries [T, heads,
        head_dim]); public, with `window_kv` and `project_out`, for attention over keys held outside
        the paged cache (the MTP block's drafting steps)."""
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(x.shape[0], self.n_heads, self.head_dim)
        return q_residual, self.ops.rotary(self.ops.unweighted_rms_norm(q, self.eps), *rope)

    def window_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The window KV [T, head_dim] of `x`'s tokens (in the compute dtype)."""
        return self.ops.rotary(self.norm(self.wkv(x)), *rope)

    def project_out(self, out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The attention output [T, heads, head_dim] with its RoPE undone, through the grouped `wo_a`
        and `wo_b`."""
        out = self.ops.rotary(out, *rope, inverse=True)
        grouped = self.ops.grouped_linear(out.reshape(out.shape[0], self.o_groups, -1), self.wo_a.weight, self.o_groups)
        return self.wo_b(grouped.flatten(1))

    def _compress(self, x: torch.Tensor, addresses: CacheAddresses, step: CompressorAddresses,
                  cache: dict[str, torch.Tensor], compress_rope: RotaryTable) -> None:
        """Pool the windows the step closes into entries (the indexer's keys too, in CSA layers)."""
        state, entries = cache["state"], cache["entries"]
        d, main_width = self.head_dim, self.compressor.state_width
        self.compressor.update(addresses.everyone(self.compressor.project(x)), step, state, entries, compress_rope,
                               slice(0, main_width), slice(0, d))
        if self.layer_type == CSA:
            self.indexer.compressor.update(
                addresses.everyone(self.indexer.compressor.project(x)), step, state, entries, compress_rope,
                slice(main_width, main_width + self.indexer.compressor.state_width),
                slice(d, d + self.indexer.head_dim),
            )

    def _row_bytes(self, addresses: CacheAddresses, step: CompressorAddresses | None) -> int:
        """`gather_bytes` of one query: its window, and its chosen (CSA) or all (HCA) entries."""
        window = addresses.window_read.shape[1]
        if step is None:
            return gather_bytes(window, self.head_dim)
        entries = step.entry_read.shape[1]
        if self.layer_type == HCA:
            return gather_bytes(window + entries, self.head_dim)
        return gather_bytes(window + min(self.indexer.topk, entries), self.head_dim, entries, self.indexer.head_dim)

    def _attend(
        self, rows: slice, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor], addresses: CacheAddresses, step: CompressorAddresses | None,
        cache: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Sink attention of the queries `rows` over their window and compressed keys, read from the
        caches through their slots."""
        entries = entry_read = entry_valid = None
        if step is not None:
            entries, entry_read, entry_valid = cache["entries"], step.entry_read[rows], step.entry_valid[rows]
            if self.layer_type == CSA:
                cos, sin = rope
                chosen, entry_valid = self.indexer.select(x[rows], q_residual[rows], cos[rows], sin[rows], entries,
                                                          entry_read, self.head_dim, entry_valid)
                entry_read = entry_read.gather(1, chosen)
        return self.ops.paged_sink_attention(q[rows], cache["window"], addresses.window_read[rows],
                                             addresses.window_valid[rows], entries, entry_read, entry_valid,
                                             self.attn_sink, self.head_dim**-0.5)
