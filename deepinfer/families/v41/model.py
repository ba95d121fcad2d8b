"""The DeepSeek-V4.1 decoder: embedding, blocks with single-pass hyper-connections, CSA2 attention and
MoE, the final collapse, norm and head.

Single-pass mHC: each sublayer collapses the residual streams with the `pre` coefficients computed
by the sublayer before it (the first attention site: all weight on stream 0, the embedding) and
hands its own `pre` on; after the last block the streams collapse with the last FFN site's `pre`.
There is no `hc_head`. Parameter names follow the released checkpoint (`embed`, `layers.{i}.*`,
`norm`, `head`), so loading is name for name except for the stacked routed experts.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.families.v41.config import DRAFT_ROLE, SWA, V41Config
from deepinfer.model.batch import CacheAddresses, PoolSpec, StepBatch
from deepinfer.families.v41.csa2 import Attention2, CacheFormats, Selection, pool_prefix
from deepinfer.families.v41.engram import Engram, EngramTokens, config_layouts, engram_rows, engram_token_map
from deepinfer.model.hyper import HyperMix
from deepinfer.model.layers import Linear, RMSNorm, empty
from deepinfer.model.moe import MoE
from deepinfer.model.rope import RotaryTable
from deepinfer.model.decoder import Decoder
from deepinfer.kernels import Ops


class Block41(nn.Module):
    MATMUL_WEIGHTS = ("hc_attn_fn", "hc_ffn_fn")

    def __init__(self, config: V41Config, ops: Ops, layer: int, formats: CacheFormats, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.role = config.roles[layer] if layer < config.num_hidden_layers else DRAFT_ROLE
        n, h = config.hc_mult, config.hidden_size
        self.attn = Attention2(config, ops, self.role, formats, dtype, device)
        self.ffn = MoE(config, ops, "moe", dtype, device)
        self.attn_norm = RMSNorm(h, config.rms_norm_eps, ops, device)
        self.ffn_norm = RMSNorm(h, config.rms_norm_eps, ops, device)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", empty((2 + n) * n, n * h, dtype=torch.float32, device=device))
            setattr(self, f"hc_{site}_base", empty((2 + n) * n, dtype=torch.float32, device=device))
            setattr(self, f"hc_{site}_scale", empty(3, dtype=torch.float32, device=device))
        self.mix = HyperMix(config, ops)
        if self.role.engram:
            self.engram = Engram(config, layer, ops, dtype, device)

    def forward(
        self, streams: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor, addresses: CacheAddresses,
        cache: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor], compress_rope: RotaryTable,
        positions: torch.Tensor, selection: Selection | None, engram_memory: torch.Tensor | None,
        tap: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Selection | None]:
        """Streams in and out [T, n, hidden]; `pre` [T, n] carried in from the previous site and out
        from this block's FFN site; the selection carried to the next layers; `engram_memory` the
        table rows this layer's tokens read (Engram layers: the memory joins every stream first).
        `tap` receives the streams the block mixes, after Engram (a reference: they are not changed)."""
        if self.role.engram:
            streams = self.engram.mix(streams, engram_memory)
        if tap is not None:
            tap.append(streams)
        attn_pre, post, comb = self.mix.coefficients(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        out, selection = self.attn(self.attn_norm.collapsed(pre, streams), addresses, cache, rope,
                                   compress_rope, positions, selection)
        streams = self.ops.hyper_expand(post, comb, out, streams)
        ffn_pre, post, comb = self.mix.coefficients(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        out = self.ffn(self.ffn_norm.collapsed(attn_pre, streams), input_ids)
        return self.ops.hyper_expand(post, comb, out, streams), ffn_pre, selection


class DeepseekV41(Decoder):
    """Stateless over the paged caches it is handed, like `DeepseekV4` (same `forward` contract).
    `cache_qdq` applies the release's cache formats (`CacheFormats`; on by default, as the reference)."""

    def __init__(self, config: V41Config, ops: Ops, dtype: torch.dtype = torch.float32, device="cpu",
                 cache_qdq: bool = True, engram_on_host: bool = False) -> None:
        super().__init__()
        self.engram_on_host = engram_on_host
        self.ops = ops
        self.config = config
        self.roles = config.roles
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        formats = CacheFormats(cache_qdq)
        self.layers = nn.ModuleList(Block41(config, ops, i, formats, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)
        self.head = Linear(config.hidden_size, config.vocab_size, ops, dtype, device)
        self.main_rope = RotaryTable(config, ops, "main")
        self.compress_rope = RotaryTable(config, ops, "compress")
        self.pools = self.pool_specs()
        self.engram_layouts = {layout.layer: layout.tensors() for layout in config_layouts(config)}
        self.engram_tokens: EngramTokens | None = None

    def use_tokenizer(self, tokenizer) -> None:
        """Engram hashes compressed token ids, which come from the checkpoint's tokenizer (checked
        against the config's `engram_compressed_vocab_size`)."""
        if self.config.engram_layer_ids:
            compressed, pad = engram_token_map(self.config, tokenizer)
            self.engram_tokens = EngramTokens(compressed, pad, self.config.engram_max_ngram_size - 1)

    def placement(self, name: str, device: torch.device | str) -> torch.device | str:
        """The Engram tables (their stored scales too) in host memory with `engram_on_host`."""
        return "cpu" if self.engram_on_host and ".engram.embed." in name else device

    def load_tensors(self, tensors: dict[str, torch.Tensor], device: torch.device | str) -> None:
        super().load_tensors(tensors, device)
        self.host_engram_layouts = self.engram_layouts
        self.engram_layouts = {layer: tuple(t.to(device) for t in layout)
                               for layer, layout in self.engram_layouts.items()}

    def engram_memory(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        """Per Engram layer, the table rows each token of the (host) `batch` reads, [T, K * head_dim],
        read from tables in host memory; the forward takes them as `batch.engram_memory`. The rows
        and their values are the ones the forward would read itself from tables on the device."""
        memory = {}
        for layer, layout in self.host_engram_layouts.items():
            rows = engram_rows(batch.engram_ids, batch.query_start, batch.engram_lookback, *layout)
            memory[layer] = self.layers[layer].engram.embed(rows)
        return memory

    def pool_specs(self) -> list[PoolSpec]:
        """Every layer's window; per KV source an entries pool ([KV | index key] per group) and, when
        it pools more than one token, a state pool."""
        config = self.config
        specs = [PoolSpec("window", "window", tuple(range(config.num_hidden_layers)), config.head_dim,
                          window=config.sliding_window)]
        for layer in config.kv_source_layer_ids:
            ratio, prefix = config.compress_ratios[layer], pool_prefix(layer)
            specs.append(PoolSpec(f"{prefix}_entries", "entries", (layer,),
                                  config.head_dim + config.index_head_dim, ratio))
            state = self.layers[layer].attn.compressor.state_width
            if state:
                specs.append(PoolSpec(f"{prefix}_state", "state", (layer,), state, ratio))
        return specs

    @torch.inference_mode()
    def forward(self, batch: StepBatch, caches: list[dict[str, torch.Tensor]],
                streams_at: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """As `DeepseekV4.forward`: every token through the layers (writing their cache rows), then the
        final hidden states [R, hidden] of the rows in `batch.sample_index` (all when None). Given
        `streams_at`, it also receives the streams [T, n, hidden] of every token entering each layer of
        `config.dspark_target_layer_ids` (after that layer's Engram): the DSpark draft's features
        (`deepinfer.families.v41.dspark.target_features`). Reading them changes nothing else. With `context`
        set, a long step's rows are split over the ranks (`deepinfer.parallel.context`)."""
        split = None if self.context is None else self.context.split(batch.input_ids.shape[0], batch.input_ids.device)
        addresses = CacheAddresses.of(batch, self.pools, self.ops, split)
        input_ids, positions = batch.input_ids, batch.positions
        if split is not None:  # this rank runs its own rows; attention gathers what they write
            input_ids, positions = input_ids[split.own], positions[split.own]
        x = self.embed(input_ids)
        n = self.config.hc_mult
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1
        ropes = {"main": self.main_rope(positions), "compress": self.compress_rope(positions)}
        selection = None
        if self.engram_layouts and batch.engram_ids is None:
            raise ValueError("this model has Engram layers: call use_tokenizer() before running it")
        for layer, block in enumerate(self.layers):
            memory = None
            if block.role.engram and batch.engram_memory is not None:
                memory = batch.engram_memory[layer]
                memory = memory if split is None else memory[split.own]
            elif block.role.engram:
                rows = self.ops.engram_rows(batch.engram_ids, batch.query_start, batch.engram_lookback,
                                            *self.engram_layouts[layer])
                memory = block.engram.embed(rows if split is None else rows[split.own])
            role = block.role
            # a compressed layer reads its KV source's entries (and, being the source, writes them)
            cache = caches[layer] if role.kind == SWA else {**caches[role.kv_source], "window": caches[layer]["window"]}
            rope = ropes["main" if role.kind == SWA else "compress"]
            tap = [] if streams_at is not None and layer in self.config.dspark_target_layer_ids else None
            streams, pre, selection = block(streams, pre, input_ids, addresses, cache, rope,
                                            self.compress_rope, positions, selection, memory, tap)
            if tap:
                streams_at[layer] = addresses.everyone(tap[0])
        if split is not None:  # each rank collapses its own rows, then all are gathered
            hidden = addresses.everyone(self.norm.collapsed(pre, streams))
            return hidden if batch.sample_index is None else hidden[batch.sample_index]
        if batch.sample_index is not None:
            streams, pre = streams[batch.sample_index], pre[batch.sample_index]
        return self.norm.collapsed(pre, streams)
