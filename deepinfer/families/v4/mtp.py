"""DeepSeek-V4's MTP block (`mtp.0.*`, next-n prediction as in DeepSeek-V3): a drafter that predicts the
token after next from the target's final streams (`deepinfer.engine.draft_runner.MTPRunner` runs it
inside engine steps).

At position i the block reads the target's final residual streams h_i [n, hidden] (before `hc_head`,
`DeepseekV4.forward(..., streams_at=...)`) and the token t_{i+1}:

- input streams: e_proj(enorm(embed(t_{i+1}))) added to each stream of h_proj(hnorm(h_i));
- one window-only V4 block (hyper-connections, attention over the block's own KV of positions
  i - W + 1 .. i, W the sliding window, and its own MoE);
- its own final collapse (`hc_head_fn`, `hc_head_base`, `hc_head_scale`), `norm` and the target's head:
  logits for t_{i+2}; `confidence` (a projection with a bias) of the same normed hidden state: the
  logit of the chance that the draft holds.

Drafting after a sequence's last token t_n: the block at n - 1 (whose input token is t_n) gives draft
1; draft j + 1 comes from the block at n + j - 1 on draft j, reading the block's own output streams at
n + j - 2 in place of the target's, which do not exist yet.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from deepinfer.families.v4.config import SLIDING, ModelConfig
from deepinfer.model.batch import CacheAddresses
from deepinfer.model.hyper import head_pre
from deepinfer.model.layers import Linear, RMSNorm, empty
from deepinfer.model.rope import RotaryTable
from deepinfer.families.v4.model import Block
from deepinfer.model.decoder import Choose, DraftDecoder, greedy
from deepinfer.kernels import Ops


def mtp_config(config: ModelConfig) -> ModelConfig:
    """`config` with the MTP block as one more layer, window-only with a plain MoE: how `Block` builds
    it, and what `Decoder.load_tensors` stacks its experts by."""
    return replace(config, num_hidden_layers=config.num_hidden_layers + 1,
                   layer_types=[*config.layer_types, SLIDING], mlp_layer_types=[*config.mlp_layer_types, "moe"])


class Confidence(nn.Module):
    """A projection hidden -> 1 with a bias: a draft's acceptance logit, in fp32."""

    MATMUL_WEIGHTS = ("weight",)

    def __init__(self, hidden: int, ops: Ops, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.ops = ops
        self.weight = empty(1, hidden, dtype=dtype, device=device)
        self.bias = empty(1, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.ops.linear(hidden, self.weight).float() + self.bias.float()).squeeze(-1)


class MTPLayer(Block):
    """`mtp.0`: a window-only `Block` plus the input projections, the final collapse, `norm` and the
    confidence head. `config` is `mtp_config`'s: the block is its last layer."""

    MATMUL_WEIGHTS = Block.MATMUL_WEIGHTS + ("hc_head_fn",)

    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device) -> None:
        super().__init__(config, ops, config.num_hidden_layers - 1, dtype, device)
        h, n, eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.hc_eps, self.norm_eps = config.hc_eps, eps
        self.enorm, self.hnorm, self.norm = (RMSNorm(h, eps, ops, device) for _ in range(3))
        self.e_proj = Linear(h, h, ops, dtype, device)
        self.h_proj = Linear(h, h, ops, dtype, device)
        self.hc_head_fn = empty(n, n * h, dtype=torch.float32, device=device)
        self.hc_head_base = empty(n, dtype=torch.float32, device=device)
        self.hc_head_scale = empty(1, dtype=torch.float32, device=device)
        self.confidence = Confidence(h, ops, dtype, device)

    def inputs(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The block's input streams [T, n, hidden] from the next tokens' embeddings [T, hidden] and the
        streams [T, n, hidden] it reads (each stream normed and projected on its own)."""
        projected = self.h_proj(self.hnorm(streams.flatten(0, 1))).view_as(streams)
        return self.e_proj(self.enorm(embedded)).unsqueeze(1) + projected

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The normed hidden state [T, hidden] of output streams, which the head and `confidence` read."""
        weights = (self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        return self.norm.collapsed(head_pre(self.ops, streams, weights, self.hc_eps, self.norm_eps), streams)


class MTP(DraftDecoder):
    """The MTP block of a V4 config with one (`num_nextn_predict_layers`; a checkpoint with more runs the
    first), parameters named as the checkpoint's `mtp.0.*` tensors (`Decoder.load_tensors`, from
    `checkpoint.loader.load_mtp_tensors`). Its window KV lives at layer `layer_id`, after the target's."""

    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__()
        if not config.num_nextn_predict_layers:
            raise ValueError("the config has no MTP block (num_nextn_predict_layers is 0)")
        self.ops = ops
        self.target_config = config
        self.config = mtp_config(config)
        self.layer_id = config.num_hidden_layers
        self.mtp = nn.ModuleList([MTPLayer(self.config, ops, dtype, device)])
        self.main_rope = RotaryTable(config, ops, "main")
        self.compress_rope = self.main_rope  # a window-only block: `load_tensors` moves the one table

    @torch.inference_mode()
    def paged(self, next_ids: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor,
              addresses: CacheAddresses, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """The block over a step's tokens through the paged window cache (`cache["window"]`, the block's
        layer of the window pool): writes the KV row of every position, then attends over each one's
        window there. `next_ids` [T]: the token after each position; `streams` [T, n, hidden]: the
        target's final streams. Returns the output streams [T, n, hidden]."""
        layer = self.mtp[0]
        rope = self.main_rope(positions)
        x = layer.inputs(self.embed(next_ids), streams)
        return layer(x, next_ids, addresses, cache, rope, self.compress_rope)

    @torch.inference_mode()
    def forward(self, next_ids: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor,
                context: torch.Tensor, context_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over R consecutive positions of S sequences without a paged cache: `next_ids` and
        `positions` [S, R], `streams` [S, R, n, hidden]; `context` [S, W - 1, head_dim] holds the KV of
        the W - 1 positions before each sequence's first, valid where `context_valid` [S, W - 1].
        Position r attends over the W keys ending at its own, as the paged cache would give them.
        Returns the output streams [S, R, n, hidden] and the R positions' KV [S, R, head_dim]."""
        count, rows = next_ids.shape
        layer = self.mtp[0]
        attn = layer.attn
        rope = self.main_rope(positions.flatten())
        index = torch.arange(rows, device=next_ids.device).unsqueeze(1) + torch.arange(context.shape[1] + 1,
                                                                                        device=next_ids.device)
        own = None

        def attend(x: torch.Tensor) -> torch.Tensor:
            nonlocal own
            _, q = attn.queries(x, rope)
            own = attn.window_kv(x, rope).view(count, rows, -1)
            keys = torch.cat([context.to(own.dtype), own], dim=1)[:, index]
            valid = torch.cat([context_valid, torch.ones(count, rows, dtype=torch.bool, device=x.device)], dim=1)
            out = self.ops.sink_attention(q, keys.flatten(0, 1), valid[:, index].flatten(0, 1), attn.attn_sink,
                                          attn.head_dim**-0.5)
            return attn.project_out(out, rope)

        ids = next_ids.flatten()
        out = layer.mixed(layer.inputs(self.embed(ids), streams.flatten(0, 1)), ids, attend)
        return out.view(count, rows, *out.shape[1:]), own

    @torch.inference_mode()
    def outputs(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, vocab] fp32, confidence logits [T] fp32) of output streams [T, n, hidden]."""
        layer = self.mtp[0]
        hidden = layer.hidden(streams)
        return self.head(hidden).float(), layer.confidence(hidden)

    @torch.inference_mode()
    def drafts(self, streams: torch.Tensor, anchors: torch.Tensor, context: torch.Tensor,
               context_valid: torch.Tensor, count: int, choose: Choose = greedy) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` drafts after the last tokens of S sequences, n = `anchors` [S] their positions: from the
        block's output streams at n - 1 [S, n, hidden] (draft 1), then one block step per further draft.
        `context` [S, W - 1, head_dim] / `context_valid`: the block's KV of positions n - W + 1 .. n - 1.
        `choose` picks draft j's tokens (slot j - 1) from its logits. Returns (drafts [S, count],
        confidence logits [S, count] fp32)."""
        logits, confidence = self.outputs(streams)
        tokens, confidences = [choose(logits, 0)], [confidence]
        for slot in range(1, count):
            out, kv = self(tokens[-1].unsqueeze(1), (anchors + slot - 1).unsqueeze(1), streams.unsqueeze(1),
                           context, context_valid)
            streams = out[:, 0]
            context = torch.cat([context, kv], dim=1)[:, 1:]
            context_valid = torch.cat([context_valid, torch.ones_like(context_valid[:, :1])], dim=1)[:, 1:]
            logits, confidence = self.outputs(streams)
            tokens.append(choose(logits, slot))
            confidences.append(confidence)
        return torch.stack(tokens, dim=1), torch.stack(confidences, dim=1)
