"""V4.1 attention (CSA2): a sliding window in every layer plus compressed entries shared across layers.

A few layers own a compressor (KV sources: `full` role). Ratio 1 keeps one entry per token (its
normalised projection); ratio r > 1 pools each non-overlapping group of r tokens (no positional
bias, unlike V4). An entry holds the compressed KV (RoPE'd at its group's first position) and the
indexer's key (from the pre-RoPE latent), in one row of the source's `entries` pool. Index
sources score the entries per query and keep the top-k: `full` layers over their own keys,
`reindex` layers over the latest KV source's keys, restricted to the candidate pool that the
candidate-source layer picked. `reuse` layers attend to the latest source's entries at the latest
index source's choice. The choice (`Selection`) is carried from layer to layer within a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from deepinfer.families.v41.config import FULL, REINDEX, SWA, LayerRole, V41Config
from deepinfer.model.batch import CacheAddresses, CompressorAddresses, gather_bytes, query_chunks
from deepinfer.model.layers import Linear, RMSNorm, empty
from deepinfer.model.rope import RotaryTable
from deepinfer.kernels import Ops


@dataclass(frozen=True)
class CacheFormats:
    """The precision the release keeps its caches in, applied as quantize-dequantize: the window KV in
    FP8 (ue8m0 scale per 32), the compressed KV in NVFP4, the indexer's queries and keys in MXFP4.
    With `qdq` false, full precision everywhere. Each format is an op of the caller's numerics table,
    so `audit capture` records what it did to the values."""

    qdq: bool

    def window(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_ue8m0_qdq(x) if self.qdq else x

    def entries(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return ops.nvfp4_qdq(x) if self.qdq else x

    def index(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return ops.mxfp4_qdq(x) if self.qdq else x


def pool_prefix(kv_source: int) -> str:
    """Pool names of a KV source's compressor: {prefix}_entries and, at ratio > 1, {prefix}_state."""
    return f"src{kv_source}"


@dataclass
class Selection:
    """The entries each token attends to, chosen by the latest index source of this step.

    slots [T, k]: the chosen entries' rows in the entries pool (the KV source's `entry_read` at the
    chosen positions, the valid ones first in ascending order of position), read once by the index
    source for every layer reusing its choice (they share its KV source); valid [T, k]; candidates
    [T, E]: the candidate pool, once the candidate-source layer has run.
    """

    slots: torch.Tensor
    valid: torch.Tensor
    candidates: torch.Tensor | None = None

    def rows(self, rows: slice) -> "Selection":
        """The selection of the queries `rows`."""
        candidates = self.candidates[rows] if self.candidates is not None else None
        return Selection(self.slots[rows], self.valid[rows], candidates)

    @staticmethod
    def joined(parts: list["Selection"]) -> "Selection":
        """The selections of consecutive row ranges as one."""
        candidates = None if parts[0].candidates is None else torch.cat([p.candidates for p in parts])
        return Selection(torch.cat([p.slots for p in parts]), torch.cat([p.valid for p in parts]), candidates)


class Compressor2(nn.Module):
    """A KV source's compressor: `wkv` (and, at ratio > 1, `wgate`) in fp32, then `norm`."""

    def __init__(self, config: V41Config, ops: Ops, ratio: int, device) -> None:
        super().__init__()
        self.ops = ops
        self.ratio, self.dim = ratio, config.head_dim
        self.wkv = Linear(config.hidden_size, config.head_dim, ops, torch.float32, device)
        if ratio > 1:
            self.wgate = Linear(config.hidden_size, config.head_dim, ops, torch.float32, device)
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, device)

    @property
    def state_width(self) -> int:
        """Width of a token's row in the state pool ([wkv | wgate]); 0 when nothing waits for a group."""
        return 2 * self.dim if self.ratio > 1 else 0

    def latents(self, x: torch.Tensor, addresses: CacheAddresses, step: CompressorAddresses,
                state: torch.Tensor | None) -> torch.Tensor:
        """Write the step's state rows (ratio > 1), then the normalised pre-RoPE latent [C, dim] of
        every group the step may close (rows for unused capacity are junk, written to the null block).
        Under a context split, `x` holds this rank's tokens and what they project is gathered first."""
        if self.ratio == 1:
            if addresses.context is None:
                return self.norm(self.wkv(x.float()[step.close_token]))
            return self.norm(addresses.everyone(self.wkv(x.float()))[step.close_token])
        wide = x.float()
        rows = torch.cat([self.wkv(wide), self.wgate(wide)], dim=-1)
        state[step.state_write] = addresses.everyone(rows).to(state.dtype)
        pooled = self.ops.paged_window_pool(state, step.close_read, step.close_valid, None, self.dim, False)
        return self.norm(pooled.to(x.dtype))


class Indexer2(nn.Module):
    """Index queries (every index source) and keys (KV sources: `wk`, `k_norm` on the latent)."""

    def __init__(self, config: V41Config, ops: Ops, role: LayerRole, formats: CacheFormats, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.role = role
        self.formats = formats
        self.n_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.block, self.top_blocks = config.candidate_block_size, config.candidate_topk_blocks
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, ops, dtype, device)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, ops, dtype, device)
        if role.kind == FULL:
            self.wk = Linear(config.head_dim, self.head_dim, ops, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops, device)

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.formats.index(self.ops, self.ops.rotary(self.k_norm(self.wk(latent)), cos, sin))

    def select(
        self, x: torch.Tensor, q_residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
        entries: torch.Tensor, entry_slots: torch.Tensor, column: int, valid: torch.Tensor, positions: torch.Tensor,
        carried: Selection | None,
    ) -> Selection:
        """Score each token's visible entries (index keys: columns `column`.. of the entries pool's rows
        `entry_slots` [T, E]; `valid` [T, E]; `positions` [T] the tokens') and keep the top-k, inside the
        candidate pool once there is one."""
        q = self.wq_b(q_residual).view(x.shape[0], self.n_heads, self.head_dim)
        q = self.formats.index(self.ops, self.ops.rotary(q, *rope))
        candidates = carried.candidates if carried is not None else None
        scored = valid & candidates if self.role.uses_candidates else valid  # -inf outside the pool too
        scores = self.ops.paged_indexer_scores(q, entries, entry_slots, column, self.weights_proj(x), scored, 1.0,
                                               weight_scale=self.head_dim**-0.5 * self.n_heads**-0.5)
        if self.role.candidate_source:
            candidates = self._candidate_pool(scores, (positions + 1) // self.role.ratio) & valid
        chosen, good = self.ops.ascending_topk(scores, min(self.topk, scores.shape[1]))
        return Selection(entry_slots.gather(1, chosen), good, candidates)

    def _candidate_pool(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Blocks of `candidate_block_size` entries scored by their best entry; the block holding the
        newest visible entry always kept; the best `candidate_topk_blocks` blocks -> mask [T, E]."""
        width = scores.shape[1]
        blocks = F.pad(scores, (0, -width % self.block), value=float("-inf")).unflatten(1, (-1, self.block)).amax(-1)
        newest = ((visible - 1) // self.block).unsqueeze(1)
        blocks = blocks.masked_fill(torch.arange(blocks.shape[1], device=scores.device) == newest, float("inf"))
        picked = self.ops.topk_indices(blocks, min(self.top_blocks, blocks.shape[1]))
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter(1, picked, blocks.gather(1, picked) > float("-inf"))
        return keep.repeat_interleave(self.block, dim=1)[:, :width]


class Attention2(nn.Module):
    def __init__(self, config: V41Config, ops: Ops, role: LayerRole, formats: CacheFormats, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.role = role
        self.formats = formats
        self.n_heads, self.head_dim, self.o_groups = config.num_attention_heads, config.head_dim, config.o_groups
        self.index_topk = config.index_topk
        self.eps = config.rms_norm_eps
        h = config.hidden_size
        self.wq_a = Linear(h, config.q_lora_rank, ops, dtype, device)
        self.q_norm = RMSNorm(config.q_lora_rank, self.eps, ops, device)
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, ops, dtype, device)
        self.wkv = Linear(h, self.head_dim, ops, dtype, device)
        self.kv_norm = RMSNorm(self.head_dim, self.eps, ops, device)
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * config.o_lora_rank, ops,
                           dtype, device)
        self.wo_b = Linear(self.o_groups * config.o_lora_rank, h, ops, dtype, device)
        self.attn_sink = empty(self.n_heads, dtype=torch.float32, device=device)
        if role.kind == FULL:
            self.compressor = Compressor2(config, ops, role.ratio, device)
        if role.kind in (FULL, REINDEX):
            self.indexer = Indexer2(config, ops, role, formats, dtype, device)

    def forward(
        self, x: torch.Tensor, addresses: CacheAddresses, cache: dict[str, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor], compress_rope: RotaryTable, positions: torch.Tensor,
        selection: Selection | None,
    ) -> tuple[torch.Tensor, Selection | None]:
        """`cache`: this layer's `window` and its KV source's `entries` (and `state`). Returns the
        output and the selection the next layers reuse."""
        tokens = x.shape[0]
        q_residual, q = self.queries(x, rope)
        kv = self.window_kv(x, rope)
        window = cache["window"]
        window[addresses.window_write] = addresses.everyone(kv).to(window.dtype)
        step = None
        if self.role.kind != SWA:
            step = addresses.compressors[pool_prefix(self.role.kv_source)]
            if self.role.kind == FULL:
                self._compress(x, addresses, step, cache["entries"], cache.get("state"), compress_rope)
        parts = [self._attend(rows, q, x, q_residual, rope, positions, addresses, step, cache, selection)
                 for rows in query_chunks(tokens, self._row_bytes(addresses, step))]
        if len(parts) == 1:
            out, selection = parts[0]
        else:
            out = torch.cat([part for part, _ in parts])
            selection = Selection.joined([chosen for _, chosen in parts]) if step is not None else selection
        return self.project_out(out, rope), selection

    def queries(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the query latent `q_norm(wq_a(x))` [T, q_lora_rank], the RoPE'd queries [T, heads, head_dim])."""
        q_residual = self.q_norm(self.wq_a(x))
        return q_residual, self.ops.rotary(self.wq_b(q_residual).view(x.shape[0], self.n_heads, self.head_dim), *rope)

    def window_kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The window KV of `x`'s tokens [T, head_dim] as the window cache keeps it (`CacheFormats.window`)."""
        return self.formats.window(self.ops, self.ops.rotary(self.kv_norm(self.wkv(x)), *rope))

    def project_out(self, out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The attention output [T, heads, head_dim] with its RoPE undone, through the grouped `wo_a` and `wo_b`."""
        out = self.ops.rotary(out, *rope, inverse=True)
        grouped = self.ops.grouped_linear(out.reshape(out.shape[0], self.o_groups, -1), self.wo_a.weight, self.o_groups)
        return self.wo_b(grouped.flatten(1))

    def _row_bytes(self, addresses: CacheAddresses, step: CompressorAddresses | None) -> int:
        """`gather_bytes` of one query: its window and selected entries, and in index sources the
        index keys of every entry it may see."""
        window = addresses.window_read.shape[1]
        if step is None:
            return gather_bytes(window, self.head_dim)
        entries = step.entry_read.shape[1]
        indexed = entries if self.role.kind in (FULL, REINDEX) else 0
        return gather_bytes(window + min(self.index_topk, entries), self.head_dim, indexed,
                            self.indexer.head_dim if indexed else 0)

    def _attend(
        self, rows: slice, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, addresses: CacheAddresses,
        step: CompressorAddresses | None, cache: dict[str, torch.Tensor], selection: Selection | None,
    ) -> tuple[torch.Tensor, Selection | None]:
        """Sink attention of the queries `rows` over their window and chosen entries (read from the
        caches through their slots), and their selection (made here in index sources, carried in from
        an earlier layer otherwise)."""
        entries = entry_slots = entry_valid = None
        if step is not None:
            entries, entry_read = cache["entries"], step.entry_read[rows]
            carried = selection.rows(rows) if selection is not None else None
            if self.role.kind in (FULL, REINDEX):
                carried = self.indexer.select(x[rows], q_residual[rows], (rope[0][rows], rope[1][rows]), entries,
                                              entry_read, self.head_dim, step.entry_valid[rows], positions[rows],
                                              carried)
            entry_slots, entry_valid = carried.slots, carried.valid
            selection = carried
        out = self.ops.paged_sink_attention(q[rows], cache["window"], addresses.window_read[rows],
                                            addresses.window_valid[rows], entries, entry_slots, entry_valid,
                                            self.attn_sink, self.head_dim**-0.5)
        return out, selection

    def _compress(self, x: torch.Tensor, addresses: CacheAddresses, step: CompressorAddresses,
                  entries: torch.Tensor, state: torch.Tensor | None, compress_rope: RotaryTable) -> None:
        """Write each group the step closes as an entry: [KV RoPE'd at the group's first position |
        the indexer's key]."""
        latent = self.compressor.latents(x, addresses, step, state)
        cos, sin = compress_rope(step.close_position)
        kv = self.formats.entries(self.ops, self.ops.rotary(latent, cos, sin))
        row = torch.cat([kv, self.indexer.keys(latent, cos, sin)], dim=-1)
        entries[step.close_write] = row.to(entries.dtype)

