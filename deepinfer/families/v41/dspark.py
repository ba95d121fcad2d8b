"""The DSpark draft model of DeepSeek-V4.1 (`mtp.{k}.*`): a block drafter (`deepinfer.engine.draft_runner`
runs it inside engine steps).

After the target has produced token t_n (from its hidden state at n - 1), one draft block proposes the
`dspark_block_size` (B) tokens at n + 1 .. n + B in a single pass of the draft layers:

- features: for every target position p < n, the streams entering each of the target layers
  `dspark_target_layer_ids` (after Engram), averaged over the streams, concatenated [3 * hidden];
  `main_x = main_norm(main_proj(features))` (`mtp.0`), one row per target position;
- each draft layer is a window-only V4.1 block with single-pass hyper-connections and its own MoE.
  Its keys are the context KV (this layer's `wkv`, `kv_norm` and RoPE on `main_x` at positions
  max(0, n - W) .. n - 1, W the sliding window) and the block's own B rows, which every block row
  sees (no causal mask inside the block); both in the window cache's format (`CacheFormats.window`);
- the block's input is [t_n, noise, ..., noise] (`dspark_noise_token_id`) at positions n .. n + B - 1,
  embedded with the target's embedding; the last layer's streams collapse into h, and
  `mtp.{last}.norm` and the target's head give the base logits U [B, vocab];
- the drafts are chosen left to right: slot j's logits are U_j + G E[prev_j] (the Markov head: E the
  `markov_head.embed` rows, G its `head`), prev_0 = t_n and prev_j the token chosen at slot j - 1;
  the confidence logit of slot j is proj([h_j ; E[prev_j]]). The released drafter was trained on the
  pre-norm h; drafters trained with NeMo AutoModel read the post-norm one (`confidence_input`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.families.v41.config import V41Config, draft_config
from deepinfer.families.v41.csa2 import CacheFormats
from deepinfer.model.layers import Linear, RMSNorm
from deepinfer.model.rope import RotaryTable
from deepinfer.model.decoder import Choose, DraftDecoder, greedy
from deepinfer.families.v41.model import Block41
from deepinfer.kernels import Ops

PRE_NORM, POST_NORM = "pre_norm", "post_norm"  # which hidden state the confidence head reads


def target_features(streams_at: dict[int, torch.Tensor], layer_ids: list[int], ops: Ops) -> torch.Tensor:
    """[T, len(layer_ids) * hidden]: per target layer (in `layer_ids`' order) its input streams [T, n,
    hidden] (`DeepseekV41.forward(..., streams_at=...)`) averaged as a fixed-order sum over the streams
    divided by n (exact for n = 4), so the features do not depend on how a library orders a mean."""
    return torch.cat([ops.ordered_sum(streams_at[layer], dim=1) / streams_at[layer].shape[1]
                      for layer in layer_ids], dim=-1)


class MarkovHead(nn.Module):
    """The rank-r token-transition bias G E[prev]: `embed` [vocab, r], `head` [vocab, r] (r -> vocab)."""

    def __init__(self, vocab: int, rank: int, ops: Ops, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        self.head = Linear(rank, vocab, ops, dtype, device)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bias [.., vocab] fp32, embedding [.., r]) of the previous tokens `prev` [..]."""
        embedding = self.embed(prev)
        return self.head(embedding).float(), embedding


class ConfidenceHead(nn.Module):
    """The acceptance logit of a slot from [hidden ; Markov embedding of its previous token], in fp32."""

    def __init__(self, width: int, ops: Ops, device) -> None:
        super().__init__()
        self.proj = Linear(width, 1, ops, torch.float32, device)

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden.float(), embedding.float()], dim=-1)).squeeze(-1)


class DraftBlock(Block41):
    """One draft layer: a window-only `Block41` (same parameters and single-pass hyper-connections)
    whose attention reads the context KV it is handed plus the block's own rows instead of a paged
    cache. The first layer also holds `main_proj` / `main_norm`, the last `norm` and the two heads."""

    def __init__(self, config: V41Config, ops: Ops, stage: int, formats: CacheFormats, dtype, device) -> None:
        super().__init__(config, ops, config.num_hidden_layers + stage, formats, dtype, device)
        h, layers, rank = config.hidden_size, config.num_draft_layers, config.dspark_markov_rank
        if stage == 0:
            self.main_proj = Linear(len(config.dspark_target_layer_ids) * h, h, ops, dtype, device)
            self.main_norm = RMSNorm(h, config.rms_norm_eps, ops, device)
        if stage == layers - 1:
            self.norm = RMSNorm(h, config.rms_norm_eps, ops, device)
            self.markov_head = MarkovHead(config.vocab_size, rank, ops, dtype, device)
            self.confidence_head = ConfidenceHead(h + rank, ops, device)

    def forward(
        self, streams: torch.Tensor, pre: torch.Tensor, context_kv: torch.Tensor, context_valid: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor], input_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """S blocks of B rows each, flattened: streams [S * B, n, hidden] and carried `pre` [S * B, n] in
        and out; `context_kv` [S, C, head_dim] with `context_valid` [S, C] the keys each block reads."""
        attn_pre, post, comb = self.mix.coefficients(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        out = self._attend(self.attn_norm.collapsed(pre, streams), context_kv, context_valid, rope)
        streams = self.ops.hyper_expand(post, comb, out, streams)
        ffn_pre, post, comb = self.mix.coefficients(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        out = self.ffn(self.ffn_norm.collapsed(attn_pre, streams), input_ids)
        return self.ops.hyper_expand(post, comb, out, streams), ffn_pre

    def _attend(self, x: torch.Tensor, context_kv: torch.Tensor, context_valid: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Sink attention of every block row over its block's context keys and all the block's own keys."""
        attn = self.attn
        _, q = attn.queries(x, rope)
        blocks, size = context_kv.shape[0], x.shape[0] // context_kv.shape[0]
        own = attn.window_kv(x, rope).view(blocks, size, -1)
        keys = torch.cat([context_kv.to(x.dtype), own], dim=1).repeat_interleave(size, dim=0)
        valid = torch.cat([context_valid, torch.ones(blocks, size, dtype=torch.bool, device=x.device)], dim=1)
        out = self.ops.sink_attention(q, keys.contiguous(), valid.repeat_interleave(size, dim=0), attn.attn_sink,
                                      attn.head_dim**-0.5)
        return attn.project_out(out, rope)


@dataclass
class BlockOutput:
    """Draft blocks' backbone output: base logits U [.., B, vocab] fp32, the collapsed hidden h
    [.., B, hidden] before and after the final norm (a leading [S] for S blocks drafted at once)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    normed: torch.Tensor


@dataclass
class Draft:
    """The drafted tokens [.., B] (slot j: the token at n + 1 + j), each slot's Markov-corrected logits
    [.., B, vocab] fp32 and confidence logits [.., B] fp32 (`confidence` is their sigmoid); a leading
    [S] for S blocks drafted at once."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence_logits: torch.Tensor

    @property
    def confidence(self) -> torch.Tensor:
        return torch.sigmoid(self.confidence_logits)


class DSpark(DraftDecoder):
    """The draft layers of a V4.1 config with draft layers (`V41Config.num_draft_layers`), parameters
    named as the checkpoint's `mtp.*` tensors (`Decoder.load_tensors`, from
    `checkpoint.loader.load_draft_tensors`); the embedding and head are the target's (`share`).
    `cache_qdq` puts the context and block KV through the window cache's format, as the target does."""

    def __init__(self, config: V41Config, ops: Ops, dtype: torch.dtype = torch.float32, device="cpu",
                 cache_qdq: bool = True, confidence_input: str = PRE_NORM) -> None:
        super().__init__()
        if not config.num_draft_layers:
            raise ValueError("the config has no DSpark draft layers (num_nextn_predict_layers and "
                             "dspark_target_layer_ids)")
        if confidence_input not in (PRE_NORM, POST_NORM):
            raise ValueError(f"confidence_input must be {PRE_NORM!r} or {POST_NORM!r}, got {confidence_input!r}")
        self.ops = ops
        self.target_config = config
        self.config = draft_config(config)  # what `Decoder.load_tensors` stacks the experts by
        self.confidence_input = confidence_input
        formats = CacheFormats(cache_qdq)
        self.mtp = nn.ModuleList(DraftBlock(self.config, ops, k, formats, dtype, device)
                                 for k in range(config.num_draft_layers))
        self.main_rope = RotaryTable(config, ops, "main")
        self.compress_rope = self.main_rope  # no compressed layers: `load_tensors` moves the one table

    @property
    def max_drafts(self) -> int:
        """One block per step: `dspark_block_size` tokens."""
        return self.config.dspark_block_size

    @torch.inference_mode()
    def features(self, streams_at: dict[int, torch.Tensor]) -> torch.Tensor:
        """`target_features` of the target layers this draft reads [T, 3 * hidden]."""
        return target_features(streams_at, self.config.dspark_target_layer_ids, self.ops)

    @torch.inference_mode()
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """main_x = main_norm(main_proj(features)) [T, hidden]: what every draft layer's context KV is made of."""
        return self._project(features)

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        first = self.mtp[0]
        return first.main_norm(first.main_proj(features))

    @torch.inference_mode()
    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each draft layer's KV [layers, T, head_dim] of the `main_x` rows at `positions` [T]."""
        return self._context_kv(main_x, positions)

    def _context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = self.main_rope(positions)
        return torch.stack([block.attn.window_kv(main_x, rope) for block in self.mtp])

    def context_positions(self, anchor: int) -> range:
        """The target positions a block at `anchor` (= n, the position of its first token) reads."""
        return range(max(0, anchor - self.config.sliding_window), anchor)

    @torch.inference_mode()
    def block(self, token: int | torch.Tensor, anchor: int, context_kv: torch.Tensor) -> BlockOutput:
        """The draft backbone on [token, noise, ...] at positions anchor .. anchor + B - 1, with the
        `context_kv` [layers, C, head_dim] of exactly `context_positions(anchor)`."""
        want = self.context_positions(anchor)
        if context_kv.shape[:2] != (len(self.mtp), len(want)):
            raise ValueError(f"a draft block at position {anchor} reads {len(want)} context rows "
                             f"(positions {want.start}..{want.stop - 1}) in each of {len(self.mtp)} layers, "
                             f"got context KV of shape {tuple(context_kv.shape)}")
        device = context_kv.device
        out = self.blocks(torch.as_tensor([token], device=device), torch.tensor([anchor], device=device),
                          context_kv.unsqueeze(1), torch.ones(1, len(want), dtype=torch.bool, device=device))
        return BlockOutput(out.logits[0], out.hidden[0], out.normed[0])

    @torch.inference_mode()
    def blocks(self, tokens: torch.Tensor, anchors: torch.Tensor, context_kv: torch.Tensor,
               context_valid: torch.Tensor) -> BlockOutput:
        """S draft blocks at once: block s on [tokens[s], noise, ...] at positions anchors[s] .. anchors[s]
        + B - 1, reading `context_kv` [layers, S, C, head_dim] where `context_valid` [S, C] holds.
        Each block's rows go through the layers on their own, so a block's bits do not depend on the
        others (with batch-invariant ops) as long as C is the same."""
        return self._blocks(tokens, anchors, context_kv, context_valid)

    def forward(self, tokens: torch.Tensor, anchors: torch.Tensor, features: torch.Tensor,
                context_valid: torch.Tensor) -> BlockOutput:
        """`blocks` straight from target features, with autograd (what `deepinfer.families.v41.dspark_distill` trains):
        block s reads the C positions anchors[s] - C .. anchors[s] - 1, whose features are features[s]
        [C, 3 * hidden], where `context_valid` [S, C] holds (positions before 0 do not)."""
        count, width = context_valid.shape
        positions = anchors.unsqueeze(1) - width + torch.arange(width, device=anchors.device)
        main_x = self._project(features.flatten(0, 1))
        kv = self._context_kv(main_x, positions.clamp(min=0).flatten()).unflatten(1, (count, width))
        return self._blocks(tokens, anchors, kv, context_valid)

    def _blocks(self, tokens: torch.Tensor, anchors: torch.Tensor, context_kv: torch.Tensor,
                context_valid: torch.Tensor) -> BlockOutput:
        config, ops = self.config, self.ops
        count, size, device = tokens.shape[0], config.dspark_block_size, tokens.device
        ids = torch.full((count, size), config.dspark_noise_token_id, dtype=torch.long, device=device)
        ids[:, 0] = tokens
        ids = ids.flatten()
        x = self.embed(ids)
        n = config.hc_mult
        streams = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros(count * size, n, dtype=torch.float32, device=device)
        pre[:, 0] = 1
        positions = (anchors.unsqueeze(1) + torch.arange(size, device=device)).flatten()
        rope = self.main_rope(positions)
        for block, kv in zip(self.mtp, context_kv):
            streams, pre = block(streams, pre, kv, context_valid, rope, ids)
        hidden = ops.hyper_collapse(pre, streams)
        normed = self.mtp[-1].norm(hidden)
        logits = self.head(normed).float()  # as `Decoder.logits`, which is inference-only
        return BlockOutput(logits.view(count, size, -1), hidden.view(count, size, -1), normed.view(count, size, -1))

    @torch.inference_mode()
    def draft(self, out: BlockOutput, token: int | torch.Tensor, choose: Choose = greedy) -> Draft:
        """One block's drafts (`drafts` for a single block)."""
        batched = BlockOutput(out.logits.unsqueeze(0), out.hidden.unsqueeze(0), out.normed.unsqueeze(0))
        tokens = torch.as_tensor(token, dtype=torch.long, device=out.logits.device).view(1)
        draft = self.drafts(batched, tokens, choose)
        return Draft(draft.tokens[0], draft.logits[0], draft.confidence_logits[0])

    @torch.inference_mode()
    def drafts(self, out: BlockOutput, tokens: torch.Tensor, choose: Choose = greedy) -> Draft:
        """The blocks' drafts chosen left to right with the Markov correction (`choose` picks each
        slot's tokens [S] from its logits [S, vocab]; greedy by default), and each slot's confidence
        logit; `tokens` [S] the blocks' first tokens."""
        last = self.mtp[-1]
        prev = tokens
        previous, chosen, logits = [], [], []
        for slot in range(out.logits.shape[1]):
            bias, _ = last.markov_head(prev)
            row = out.logits[:, slot] + bias
            pick = choose(row, slot)
            previous.append(prev)
            chosen.append(pick)
            logits.append(row)
            prev = pick
        hidden = out.hidden if self.confidence_input == PRE_NORM else out.normed
        confidence = last.confidence_head(hidden, last.markov_head.embed(torch.stack(previous, dim=1)))
        return Draft(torch.stack(chosen, dim=1), torch.stack(logits, dim=1), confidence)

    @torch.inference_mode()
    def propose(self, token: int | torch.Tensor, anchor: int, main_x: torch.Tensor,
                choose: Choose = greedy) -> Draft:
        """One block end to end, from the `main_x` rows of target positions 0 .. anchor - 1 (at least)."""
        positions = self.context_positions(anchor)
        rows = torch.arange(positions.start, positions.stop, device=main_x.device)
        kv = self.context_kv(main_x[rows], rows)
        return self.draft(self.block(token, anchor, kv), token, choose)
