"""The parallel layout of one engine process, and starting torch.distributed for it.

Launched by `torchrun --nproc-per-node N`, every process runs the same program over its own engine.
`expert_parallel` spreads each MoE layer's routed experts over the ranks; `data_parallel` gives each
rank (or each group of ranks) its own requests, whose attention and caches it alone holds. Each is 1
or the world size. Ranks that share requests run the same steps (their engines are configured alike
and see the same requests), and every rank runs each step's MoE layers together with the others:
a rank with nothing to run takes part with no tokens (`ExpertExchange.idle`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.errors import DeepInferError


class ParallelError(DeepInferError):
    pass


@dataclass(frozen=True)
class ParallelLayout:
    rank: int = 0
    world: int = 1
    expert_parallel: int = 1
    data_parallel: int = 1
    context_parallel: int = 1

    @property
    def attention_ranks(self) -> int:
        """How many ranks share each request (and run its attention alike)."""
        return self.world // self.data_parallel

    @property
    def attention_group(self) -> int:
        """Which share of the requests this rank serves (0 .. data_parallel - 1)."""
        return self.rank // self.attention_ranks

    @property
    def lockstep(self) -> bool:
        """Whether steps are collective: ranks exchange tokens in every MoE layer, or split long steps."""
        return self.expert_parallel > 1 or self.context_parallel > 1

    def serves(self, index: int) -> bool:
        """Whether request `index` of a batch every rank was given is this rank's (round robin over
        the data-parallel groups)."""
        return index % self.data_parallel == self.attention_group

    def describe(self) -> dict:
        return {"world": self.world, "expert_parallel": self.expert_parallel, "data_parallel": self.data_parallel,
                "context_parallel": self.context_parallel}


def start_layout(expert_parallel: int, data_parallel: int, context_parallel: int,
                 device: torch.device) -> ParallelLayout:
    """This process's layout: the world of an initialised process group, else of torchrun's
    environment (initialising the group: NCCL for CUDA, gloo for CPU; on CUDA each process takes the
    GPU of its local rank), else one process. Degrees other than 1 or the world size are refused, and
    context parallelism beside data parallelism (each rank must run every request)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    degrees = {"expert_parallel": expert_parallel, "data_parallel": data_parallel, "context_parallel": context_parallel}
    for name, degree in degrees.items():
        if degree not in (1, world):
            raise ParallelError(f"{name}={degree} needs {degree} processes (torchrun --nproc-per-node {degree}); "
                                f"this run has {world}")
    if context_parallel > 1 and data_parallel > 1:
        raise ParallelError("context_parallel runs with data_parallel=1 (every rank runs every request)")
    if world == 1:
        return ParallelLayout()
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ParallelLayout(dist.get_rank(), world, expert_parallel, data_parallel, context_parallel)


def all_to_all(tensor: torch.Tensor, send: list[int], receive: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rows of `tensor` [S, ...] sent `send[r]` to rank r, in order; returns the rows received,
    `receive[r]` from rank r, in rank order. The bytes travel as they are (any dtype, bit for bit)."""
    shape, dtype = tensor.shape[1:], tensor.dtype
    row_bytes = shape.numel() * tensor.element_size()
    raw = tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], row_bytes)
    out = raw.new_empty(sum(receive), row_bytes)
    dist.all_to_all_single(out, raw, output_split_sizes=receive, input_split_sizes=send, group=group)
    return out.view(dtype).reshape(out.shape[0], *shape)


def all_gather_rows(part: torch.Tensor, places: list[torch.Tensor], tokens: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's rows of `part` [n_r, ...] (rank r's going to rows `places[r]`) as one [tokens, ...]
    tensor on every rank of `group` (a collective; bytes as they are, ranks' counts may differ)."""
    padded = part.new_zeros(max(len(place) for place in places), *part.shape[1:])
    padded[:part.shape[0]] = part
    raw = padded.view(torch.uint8)
    received = [torch.empty_like(raw) for _ in places]
    dist.all_gather(received, raw, group=group)
    full = part.new_empty(tokens, *part.shape[1:])
    for place, rows in zip(places, received):
        full[place] = rows.view(part.dtype)[:len(place)]
    return full


def agree(value: int, op: dist.ReduceOp = dist.ReduceOp.MIN) -> int:
    """`value` reduced over every rank (the smallest by default); `value` itself without a group."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def process_rank() -> int:
    """This process's rank in a torchrun launch (0 alone), known before the process group starts."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def gather_objects(value: object) -> list:
    """`value` from every rank, in rank order (a collective; [value] without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def from_rank_zero(value: object) -> object:
    """Rank 0's `value` on every rank (a collective; `value` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
