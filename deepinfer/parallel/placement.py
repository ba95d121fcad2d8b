"""Where each MoE layer's experts live: logical experts (what the router picks) held as physical
copies, a fixed number per rank, and the balancing policy that chooses them from measured loads.

The policy is the one DeepSeek published for its expert-parallel load balancer (EPLB), in our own
code: give the heaviest experts extra copies until the physical slots are used up (each copy taking
an equal share of its expert's load), then pack the copies onto ranks so every rank holds the same
number and the loads come out as even as a greedy pass makes them. With several nodes and expert
groups that divide among them, groups go to nodes first (a token's experts then stay within few
nodes) and the copies are packed within each node; otherwise packing is global.

Where a copy lives never changes what it computes: a slot's output depends only on its token's row
and its expert's weights (`kernels.fast.expert_outputs`), so any placement gives the same bits.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from deepinfer.errors import DeepInferError


class PlacementError(DeepInferError, ValueError):
    pass


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer: `ranks[r]` lists the logical expert of each physical slot rank r holds, in the
    order the rank stacks them. Every rank holds the same number of slots; every expert at least one."""

    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def contiguous(cls, n_experts: int, ranks: int) -> ExpertPlacement:
        """Experts in order, ceil(n / ranks) slots per rank; where n does not divide, the last slots
        hold second copies of the first experts."""
        per_rank = -(-n_experts // ranks)
        slots = [e % n_experts for e in range(per_rank * ranks)]
        return cls(tuple(tuple(slots[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)))

    def check(self, n_experts: int) -> None:
        """PlacementError unless every rank holds the same number of valid slots and every expert is held."""
        sizes = {len(held) for held in self.ranks}
        if len(sizes) != 1 or not sizes.pop():
            raise PlacementError(f"every rank must hold the same positive number of experts, got "
                                 f"{[len(held) for held in self.ranks]}")
        held = {e for rank in self.ranks for e in rank}
        outside = sorted(e for e in held if not (isinstance(e, int) and 0 <= e < n_experts))
        if outside:
            raise PlacementError(f"expert {outside[0]} is out of range [0, {n_experts})")
        missing = sorted(set(range(n_experts)) - held)
        if missing:
            raise PlacementError(f"expert {missing[0]} is held by no rank")

    @property
    def per_rank(self) -> int:
        return len(self.ranks[0])

    def copies(self, expert: int) -> list[tuple[int, int]]:
        """(rank, slot) of every copy of `expert`, by rank then slot."""
        return [(r, s) for r, held in enumerate(self.ranks) for s, e in enumerate(held) if e == expert]


_EXPERT_TENSOR = re.compile(r"\.ffn\.experts\.(\d+)\.")


def held_tensors(n_experts: int, rank: int, ranks: int):
    """Whether a checkpoint tensor is needed on `rank` under the default (contiguous) placement: every
    tensor but the routed experts' of experts other ranks hold (a rank loads only its share)."""
    held = set(ExpertPlacement.contiguous(n_experts, ranks).ranks[rank])

    def needed(name: str) -> bool:
        match = _EXPERT_TENSOR.search(name)
        return match is None or int(match.group(1)) in held

    return needed


def placement_digest(placements: list[ExpertPlacement]) -> str:
    """SHA-256 of a model's placements (one per MoE layer), for manifests."""
    text = json.dumps([placement.ranks for placement in placements], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def replicate(loads: list[float], slots: int) -> list[int]:
    """How many copies of each expert fill `slots`: one each, then each further copy to the expert
    with the most load per copy (lowest id on ties)."""
    if slots < len(loads):
        raise PlacementError(f"{slots} physical slots cannot hold {len(loads)} experts")
    counts = [1] * len(loads)
    for _ in range(slots - len(loads)):
        heaviest = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        counts[heaviest] += 1
    return counts


def pack(weights: list[float], bins: int, labels: list[int] | None = None) -> list[list[int]]:
    """Items split into `bins` bins of len(weights) / bins items each: heaviest item first (lowest
    index on ties), each into the lightest bin with room (lowest bin on ties), avoiding bins that hold
    an item of the same label (two copies of one expert on one rank would share its load for nothing)."""
    if len(weights) % bins:
        raise PlacementError(f"{len(weights)} items do not split evenly into {bins} bins")
    labels = labels if labels is not None else list(range(len(weights)))
    room = len(weights) // bins
    packed: list[list[int]] = [[] for _ in range(bins)]
    totals = [0.0] * bins
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min((b for b in range(bins) if len(packed[b]) < room),
                     key=lambda b: (any(labels[i] == labels[item] for i in packed[b]), totals[b], b))
        packed[target].append(item)
        totals[target] += weights[item]
    return packed


def balanced_placement(loads: list[float], ranks: int, per_rank: int, nodes: int = 1,
                       groups: int = 1) -> ExpertPlacement:
    """The EPLB placement of one layer whose experts carried `loads`: `ranks` ranks of `per_rank`
    slots, hierarchical over `nodes` nodes when `groups` expert groups divide among them, global
    otherwise. Each rank lists its slots by expert id."""
    n = len(loads)
    if ranks < 1 or per_rank < 1 or nodes < 1 or groups < 1:
        raise PlacementError("ranks, per_rank, nodes and groups must be positive")
    if ranks % nodes or n % groups:
        raise PlacementError(f"{ranks} ranks over {nodes} nodes, {n} experts in {groups} groups: not even")
    hierarchical = nodes > 1 and groups % nodes == 0
    if not hierarchical:
        nodes, groups = 1, 1
    group_size = n // groups
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    held: list[tuple[int, ...]] = []
    for node_groups in pack(group_loads, nodes):
        experts = [e for g in sorted(node_groups) for e in range(g * group_size, (g + 1) * group_size)]
        counts = replicate([loads[e] for e in experts], ranks // nodes * per_rank)
        copies = [e for e, count in zip(experts, counts) for _ in range(count)]
        shares = [loads[e] / counts[experts.index(e)] for e in copies]
        held += [tuple(sorted(copies[i] for i in rank)) for rank in pack(shares, ranks // nodes, copies)]
    placement = ExpertPlacement(tuple(held))
    placement.check(n)
    return placement


def rank_loads(placement: ExpertPlacement, loads: list[float]) -> list[float]:
    """The load each rank serves when every expert's load splits evenly over its copies."""
    counts = {e: len(placement.copies(e)) for e in range(len(loads))}
    return [sum(loads[e] / counts[e] for e in held) for held in placement.ranks]
