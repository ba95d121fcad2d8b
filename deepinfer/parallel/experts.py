"""Routed experts spread over ranks (expert parallelism), bit for bit what one rank computes.

Each MoE layer's `ExpertExchange` takes the tokens this rank dispatches (all of its tokens, or with
ranks sharing requests, every m-th one), and for each (token, top-k rank) slot picks a copy of its
expert (`ExpertPlacement`). The slots go to the copies' ranks in a fixed order: sorted by destination
rank, slots in (token, rank) order within one, so a rank receives them by source rank and token.
There each slot runs through its expert alone (`ops.expert_outputs`: a slot's output depends on its
row and its expert only), the outputs come back in the order they were sent, and the token's owner
weights and sums its slots in top-k order (`ops.weighted_combine`), the combine one rank runs: the
same bits for any number of ranks and any placement. The shared expert stays where the token is.

The exchange's sizes are either the step's own (each rank tells the others how many slots it sends,
read on the host in every layer), or, with a `capacity`, fixed: every rank sends every rank exactly
`capacity` rows per layer (its slots for that rank in the same order, then empty rows, whose expert
slot is -1), so a layer reads nothing back to the host. Slots past a destination's capacity are not
sent (their outputs are zero) and counted in `overflow`, on the device: the engine runs such a step
again with the step's own sizes (`deepinfer.engine.core`), so outputs keep their bits either way.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.model.moe import MoE
from deepinfer.parallel.context import ContextGroup
from deepinfer.parallel.layout import ParallelLayout, all_gather_rows, all_to_all
from deepinfer.parallel.placement import ExpertPlacement, PlacementError
from deepinfer.kernels.quant import QuantizedWeight


def exchange_capacity(factor: float, step_rows: int, attention_ranks: int, top_k: int, world: int) -> int:
    """Rows each rank sends each rank per MoE layer under a fixed capacity: `factor` times a rank's even
    share of the slots dispatched from a step of `step_rows` padded rows (each rank of those sharing
    requests dispatches 1/attention_ranks of them), at least one."""
    return max(1, math.ceil(factor * math.ceil(step_rows / attention_ranks) * top_k / world))


class ExpertExchange:
    """One MoE layer's dispatch and combine. `attention` is the process group of the ranks that share
    this rank's requests (None when it serves its own); `loads` counts the slots each logical expert
    received from this rank's tokens since the last `take_loads`, the step's real tokens only:
    `step_rows`, set by `EngineCore.step` before each step, is how many of the step's rows are
    tokens (the rest pad the step to its bucket; None counts every row). `capacity`, also set per step
    by the engine (the same on every rank), fixes the rows sent to each rank (None: the step's own
    sizes); `overflow` counts the slots a capacity left out since the last `take_overflow`. With
    context parallelism beside it (`context`, the model's `ContextGroup`), a step split over the ranks
    brings each rank's own rows: it dispatches all of them and gathers nothing (the model gathers the
    rows at its end); a step run whole on every rank is shared out as under data_parallel=1."""

    def __init__(self, experts: nn.Module, layout: ParallelLayout, placement: ExpertPlacement, n_experts: int,
                 top_k: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 attention: dist.ProcessGroup | None) -> None:
        self.experts = experts  # `deepinfer.model.moe.Experts`: this rank's copies
        self.layout, self.top_k, self.hidden_size, self.dtype = layout, top_k, hidden_size, dtype
        self.attention = attention
        self.loads = torch.zeros(n_experts, dtype=torch.int64, device=device)
        self.step_rows: int | None = None
        self.context: ContextGroup | None = None
        self.capacity: int | None = None
        self.overflow = torch.zeros((), dtype=torch.int64, device=device)
        self.place(placement)

    def place(self, placement: ExpertPlacement) -> None:
        """Route to `placement`'s copies from now on (its weights must be in place by the next step)."""
        n = self.loads.shape[0]
        placement.check(n)
        copies = [placement.copies(e) for e in range(n)]
        width = max(len(c) for c in copies)
        ranks = [[r for r, _ in c] + [0] * (width - len(c)) for c in copies]
        slots = [[s for _, s in c] + [0] * (width - len(c)) for c in copies]
        device = self.loads.device
        self.placement = placement
        self.copy_rank = torch.tensor(ranks, dtype=torch.int64, device=device)
        self.copy_slot = torch.tensor(slots, dtype=torch.int64, device=device)
        self.copy_count = torch.tensor([len(c) for c in copies], dtype=torch.int64, device=device)

    def routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
               shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' combined output [T, H] for this rank's tokens x [T, H] routed to
        `indices` / `weights` [T, k], plus `shared` [T, H] (the shared expert's) when given."""
        split = None if self.context is None else self.context.current
        members = 1 if split is not None else self.layout.attention_ranks
        member = self.layout.rank % members
        tokens = x.shape[0]
        mine = torch.arange(tokens, device=x.device)[member::members]
        picked = indices[mine]
        step_index = mine if split is None else split.own  # each row's place in the step, padding last
        real = torch.ones_like(mine) if self.step_rows is None else (step_index < self.step_rows).long()
        self.loads.index_add_(0, picked.reshape(-1), real.repeat_interleave(self.top_k))  # no sizes read back
        flat = picked.reshape(-1)
        rows = torch.arange(flat.shape[0], device=x.device) // self.top_k
        copy = mine[rows] % self.copy_count[flat]  # spreads one expert's slots over its copies
        dest, slot = self.copy_rank[flat, copy], self.copy_slot[flat, copy]
        order = torch.sort(dest, stable=True).indices
        exchange = self._sized if self.capacity is None else self._fixed
        returned = exchange(x[mine][rows[order]], dest[order], slot[order])
        slots = torch.empty_like(returned)
        slots[order] = returned
        combined = self.experts.ops.weighted_combine(slots.view(mine.shape[0], self.top_k, self.hidden_size),
                                                     weights[mine], None if shared is None else shared[mine])
        return combined if members == 1 else self._gather(combined, tokens)

    def _sized(self, rows: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The expert outputs of slots `rows` [S, H] (sorted by destination rank `dest`, each for its
        expert slot there), in that order, over exchanges of the step's own sizes."""
        send = torch.bincount(dest, minlength=self.layout.world)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send)
        send_counts, receive_counts = send.tolist(), receive.tolist()
        inputs = all_to_all(rows, send_counts, receive_counts)
        slots_in = all_to_all(slots, send_counts, receive_counts)
        return all_to_all(self.experts.outputs(inputs, slots_in), receive_counts, send_counts)

    def _fixed(self, rows: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """As `_sized`, over exchanges of `capacity` rows per rank pair: no host read. A slot past its
        destination's capacity is not sent; its output is zero, and it is counted in `overflow`."""
        world, capacity = self.layout.world, self.capacity
        counts = torch.zeros(world, dtype=torch.int64, device=dest.device).index_add_(0, dest, torch.ones_like(dest))
        place = torch.arange(dest.shape[0], device=dest.device) - (torch.cumsum(counts, 0) - counts)[dest]
        sent = place < capacity
        self.overflow += (~sent).sum()
        spare = world * capacity  # one more row, where the slots not sent go (dropped before sending)
        at = torch.where(sent, dest * capacity + place, spare)
        buffer = rows.new_zeros(spare + 1, rows.shape[1])
        buffer[at] = rows
        expert = slots.new_full((spare + 1,), -1)
        expert[at] = slots
        sizes = [capacity] * world
        inputs = all_to_all(buffer[:spare], sizes, sizes)
        slots_in = all_to_all(expert[:spare], sizes, sizes)
        outputs = self.experts.outputs(inputs, slots_in.clamp(min=0))  # an empty row runs slot 0; dropped
        returned = all_to_all(outputs, sizes, sizes)
        return torch.cat([returned, returned.new_zeros(1, returned.shape[1])])[at]

    def take_overflow(self) -> torch.Tensor:
        """Slots a capacity left out since the last call (a device scalar: the caller reads it)."""
        count = self.overflow.clone()
        self.overflow.zero_()
        return count

    def idle(self) -> None:
        """Take part in the layer with no tokens: other ranks' slots may still come here."""
        device = self.loads.device
        self.routed(torch.empty(0, self.hidden_size, dtype=self.dtype, device=device),
                    torch.empty(0, self.top_k, dtype=torch.int64, device=device),
                    torch.empty(0, self.top_k, dtype=torch.float32, device=device))

    def _gather(self, combined: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every token's combined row, from the ranks sharing the requests (member j dispatched tokens
        j, j + m, ...)."""
        members = self.layout.attention_ranks
        rows = torch.arange(tokens, device=combined.device)
        return all_gather_rows(combined, [rows[j::members] for j in range(members)], tokens, self.attention)

    def take_loads(self) -> torch.Tensor:
        """Slots per logical expert from every rank's tokens since the last call (a collective)."""
        loads = self.loads.clone()
        self.loads.zero_()
        dist.all_reduce(loads)
        return loads


def spread_experts(model: nn.Module, layout: ParallelLayout, device: torch.device,
                   placements: list[ExpertPlacement] | None = None) -> list[ExpertExchange]:
    """Give each of `model`'s MoE layers (in forward order) this rank's share of its experts and an
    exchange; before the weights load, which then stack only the experts held here. Every rank calls
    it (it makes the process groups of ranks sharing requests). `placements`: one per layer (default:
    `ExpertPlacement.contiguous`)."""
    layers = [module for module in model.modules() if isinstance(module, MoE)]
    n_experts = model.config.n_routed_experts
    if placements is None:
        placements = [ExpertPlacement.contiguous(n_experts, layout.world)] * len(layers)
    if len(placements) != len(layers):
        raise PlacementError(f"{len(placements)} placements for {len(layers)} MoE layers")
    attention = None
    members = layout.attention_ranks
    if 1 < members < layout.world:
        for group in range(layout.data_parallel):
            made = dist.new_group(list(range(group * members, (group + 1) * members)))
            attention = made if group == layout.attention_group else attention
    exchanges = []
    for moe, placement in zip(layers, placements):
        exchange = ExpertExchange(moe.experts, layout, placement, n_experts, model.config.num_experts_per_tok,
                                  model.config.hidden_size, moe.experts.w13.dtype, device, attention)
        moe.experts.held = placement.ranks[layout.rank]
        moe.exchange = exchange
        exchanges.append(exchange)
    return exchanges


def move_experts(exchange: ExpertExchange, placement: ExpertPlacement) -> None:
    """Re-place one MoE layer's experts between steps: every rank receives the weights of the copies
    `placement` gives it from the lowest rank that holds them now (a collective), then routes to them."""
    layout, old = exchange.layout, exchange.placement
    placement.check(exchange.loads.shape[0])
    if len(placement.ranks) != layout.world:
        raise PlacementError(f"a placement over {len(placement.ranks)} ranks for {layout.world}")
    plan = [(dest, slot, *old.copies(expert)[0]) for dest, held in enumerate(placement.ranks)
            for slot, expert in enumerate(held)]  # (dest, its slot, source, source's slot)
    outgoing = [source_slot for _, _, source, source_slot in plan if source == layout.rank]
    send = [sum(1 for d, _, s, _ in plan if s == layout.rank and d == dest) for dest in range(layout.world)]
    receive = [sum(1 for d, _, s, _ in plan if d == layout.rank and s == source) for source in range(layout.world)]
    arrival = [slot for source in range(layout.world) for d, slot, s, _ in plan if d == layout.rank and s == source]
    experts = exchange.experts
    for name in ("w13", "w2"):
        weight = getattr(experts, name)
        parts = (weight.data, weight.scale) if isinstance(weight, QuantizedWeight) else (weight,)
        moved = []
        for part in parts:  # moved as bytes: some formats (E8M0 scales) have no indexing kernels
            raw = part.contiguous().view(torch.uint8)
            index = torch.tensor(outgoing, dtype=torch.int64, device=part.device)
            received = all_to_all(raw.index_select(0, index), send, receive)
            stacked = torch.empty_like(received)
            stacked[torch.tensor(arrival, dtype=torch.int64, device=part.device)] = received
            moved.append(stacked.view(part.dtype))
        if isinstance(weight, QuantizedWeight):
            object.__setattr__(experts, name, replace(weight, data=moved[0], scale=moved[1]))
        else:
            experts._parameters[name] = nn.Parameter(experts.ops.matmul_layout(moved[0]), requires_grad=False)
    experts.held = placement.ranks[layout.rank]
    exchange.place(placement)

