"""The DeepSeek-V4 decoder: embedding, hyper-connected blocks, final collapse, norm and head.

Parameter names follow the checkpoint's tensor names (what `DeepseekV4ForCausalLM.save_pretrained`
writes), so loading is a name-for-name copy except for the routed experts, which are stacked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.families.v4.config import CSA, SLIDING, ModelConfig
from deepinfer.families.v4.attention import POOL_PREFIX, Attention
from deepinfer.model.batch import CacheAddresses, PoolSpec, StepBatch
from deepinfer.model.decoder import Decoder
from deepinfer.model.hyper import HyperHead, HyperMix
from deepinfer.model.layers import Linear, RMSNorm, empty
from deepinfer.model.moe import MoE
from deepinfer.model.rope import RotaryTable
from deepinfer.kernels import Ops


class Block(nn.Module):
    MATMUL_WEIGHTS = ("hc_attn_fn", "hc_ffn_fn")

    def __init__(self, config: ModelConfig, ops: Ops, layer_idx: int, dtype, device) -> None:
        super().__init__()
        self.ops = ops
        n, h = config.hc_mult, config.hidden_size
        mix = (2 + n) * n
        self.attn = Attention(config, ops, config.layer_types[layer_idx], dtype, device)
        self.ffn = MoE(config, ops, config.mlp_layer_types[layer_idx], dtype, device)
        self.attn_norm = RMSNorm(h, config.rms_norm_eps, ops, device)
        self.ffn_norm = RMSNorm(h, config.rms_norm_eps, ops, device)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", empty(mix, n * h, dtype=torch.float32, device=device))
            setattr(self, f"hc_{site}_base", empty(mix, dtype=torch.float32, device=device))
            setattr(self, f"hc_{site}_scale", empty(3, dtype=torch.float32, device=device))
        self.mix = HyperMix(config, ops)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, addresses: CacheAddresses,
        cache: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor], compress_rope: RotaryTable,
    ) -> torch.Tensor:
        return self.mixed(streams, input_ids, lambda x: self.attn(x, addresses, cache, rope, compress_rope))

    def mixed(self, streams: torch.Tensor, input_ids: torch.Tensor,
              attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block with its attention given as a function of the normed attention input [T, hidden]:
        the MTP block's drafting steps attend over keys they hold themselves, not the paged cache."""
        post, comb, x = self.mix(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.attn_norm)
        attended = attend(x)
        streams = self.ops.hyper_expand(post, comb, attended, streams)
        post, comb, x = self.mix(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm)
        return self.ops.hyper_expand(post, comb, self.ffn(x, input_ids), streams)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype, device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(config, ops, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, device)
        self.hc_head = HyperHead(config, ops, device)


class DeepseekV4(Decoder):
    """Stateless over the paged caches it is handed: `forward` returns the hidden states of the rows
    the step samples or scores, `logits` turns hidden states into fp32 logits."""

    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__()
        self.ops = ops
        self.config = config
        self.hc_mult = config.hc_mult
        self.model = Backbone(config, ops, dtype, device)
        self.head = Linear(config.hidden_size, config.vocab_size, ops, dtype, device)
        self.main_rope = RotaryTable(config, ops, "main")
        self.compress_rope = RotaryTable(config, ops, "compress")
        self.pools = self.pool_specs()

    @property
    def embed(self) -> nn.Embedding:
        return self.model.embed_tokens

    def pool_specs(self) -> list[PoolSpec]:
        """The cache pools: every layer's window, and per compressed layer type (CSA, HCA) a state and
        an entries pool with one slice per layer of that type."""
        config = self.config
        specs = [PoolSpec("window", "window", tuple(range(config.num_hidden_layers)), config.head_dim,
                          window=config.sliding_window)]
        for layer_type, prefix in POOL_PREFIX.items():
            layers = tuple(i for i, t in enumerate(config.layer_types) if t == layer_type)
            if not layers:
                continue
            widths = self.model.layers[layers[0]].attn.cache_widths()
            for kind in ("state", "entries"):
                specs.append(PoolSpec(f"{prefix}_{kind}", kind, layers, widths[kind],
                                      config.compress_rates[layer_type], overlap=layer_type == CSA))
        return specs

    @torch.inference_mode()
    def forward(self, batch: StepBatch, caches: list[dict[str, torch.Tensor]],
                streams_at: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs every token of the step through the layers (writing their cache rows) and returns the
        final hidden states [R, hidden] of the rows listed in `batch.sample_index` (all when None).
        Shapes follow the batch's buckets only, and nothing is read back to the host. Given
        `streams_at`, it also receives under key `num_hidden_layers` the final streams [T, n, hidden]
        of every token, before `hc_head` (what the MTP block reads, `deepinfer.families.v4.mtp`; keys are the
        layer the streams enter, as in `DeepseekV41.forward`). Reading them changes nothing else.
        With `context` set, a long step's rows are split over the ranks (`deepinfer.parallel.context`)."""
        split = None if self.context is None else self.context.split(batch.input_ids.shape[0], batch.input_ids.device)
        addresses = CacheAddresses.of(batch, self.pools, self.ops, split)
        input_ids, positions = batch.input_ids, batch.positions
        if split is not None:  # this rank runs its own rows; attention gathers what they write
            input_ids, positions = input_ids[split.own], positions[split.own]
        x = self.model.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        ropes = {"main": self.main_rope(positions), "compress": self.compress_rope(positions)}
        for block, cache in zip(self.model.layers, caches):
            rope = ropes["main" if block.attn.layer_type == SLIDING else "compress"]
            streams = block(streams, input_ids, addresses, cache, rope, self.compress_rope)
        if split is not None and streams_at is None:  # each rank heads its own rows, then all are gathered
            hidden = addresses.everyone(self.model.norm.collapsed(self.model.hc_head(streams), streams))
            return hidden if batch.sample_index is None else hidden[batch.sample_index]
        streams = addresses.everyone(streams)
        if streams_at is not None:
            streams_at[self.config.num_hidden_layers] = streams
        if batch.sample_index is not None:
            streams = streams[batch.sample_index]
        return self.model.norm.collapsed(self.model.hc_head(streams), streams)
