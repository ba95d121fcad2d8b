"""What every family's model shares: `Decoder` (fp32 logits from `head`, loading checkpoint tensors
by name) and `DraftDecoder` (a draft model on its target's embedding and head)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.kernels.quant import QuantizedWeight
from deepinfer.model.layers import Linear


class Decoder(nn.Module):
    """What both model families share: fp32 logits from `head`, and loading checkpoint tensors by name.
    Subclasses set `ops`, `config`, `embed`, `head`, `main_rope` and `compress_rope`; a model with
    Engram sets `engram_tokens` (`deepinfer.families.v41.engram.EngramTokens`), which the runner turns into
    step inputs."""

    engram_tokens = None
    engram_on_host = False  # V4.1 with its Engram tables in host memory: the runner reads them
    context = None  # `deepinfer.parallel.context.ContextGroup` when a step's rows are split over ranks

    def placement(self, name: str, device: torch.device | str) -> torch.device | str:
        """Where the parameter `name` lives: `device`, unless the model keeps it elsewhere."""
        return device

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def load_tensors(
        self, tensors: dict[str, torch.Tensor], device: torch.device | str) -> None:
        """Take checkpoint tensors by name (stacking `ffn.experts.{e}.w{1,2,3}` per layer, for the
        experts each layer's `Experts.held` lists) as the model's parameters on `device`. The weights
        that modules list in `MATMUL_WEIGHTS` pass through `ops.matmul_layout` (the numerics mode's
        preferred storage order; values unchanged).
        A `QuantizedWeight` replaces its parameter as a plain attribute: it is not a tensor, and the
        ops decode it where it is used.

        The model may be built on the meta device: parameters are replaced, not copied into.
        Tensors are popped from `tensors` as they are consumed, so a caller that hands over its
        only reference keeps peak memory near one model's worth.
        """
        n_experts = self.config.n_routed_experts
        self.main_rope.to(device)
        self.compress_rope.to(device)
        entries = [(name, p, True) for name, p in self.named_parameters()]
        entries += [(name, b, False) for name, b in self.named_buffers()]
        for name, current, is_param in entries:
            prefix, attr = name.rsplit(".", 1) if "." in name else ("", name)
            if attr == "w13":
                held = self.get_submodule(prefix).held
                value = _stack([_cat([tensors[f"{prefix}.{e}.w1.weight"], tensors[f"{prefix}.{e}.w3.weight"]])
                                for e in held])
                _drop(tensors, prefix, n_experts, ("w1", "w3"))
            elif attr == "w2" and prefix.endswith("experts"):
                value = _stack([tensors[f"{prefix}.{e}.w2.weight"] for e in self.get_submodule(prefix).held])
                _drop(tensors, prefix, n_experts, ("w2",))
            else:
                value = tensors.pop(name)
            module = self.get_submodule(prefix) if prefix else self
            target = self.placement(name, device)
            if isinstance(value, QuantizedWeight):  # kept as stored: no parameter, the kernels decode it
                del module._parameters[attr]
                object.__setattr__(module, attr, value.to(target))
                continue
            value = value.to(device=target, dtype=current.dtype)
            if attr in getattr(module, "MATMUL_WEIGHTS", ()):
                value = self.ops.matmul_layout(value)
            if is_param:
                module._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[attr] = value


def _drop(tensors: dict, prefix: str, n_experts: int, names: tuple[str, ...]) -> None:
    """Forget every expert's `names` weights of layer `prefix`, held here or not (a rank's share of a
    preset never had the others)."""
    for e in range(n_experts):
        for name in names:
            tensors.pop(f"{prefix}.{e}.{name}.weight", None)


def _cat(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    return QuantizedWeight.cat(parts) if isinstance(parts[0], QuantizedWeight) else torch.cat(parts)


def _stack(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    return QuantizedWeight.stack(parts) if isinstance(parts[0], QuantizedWeight) else torch.stack(parts)


Choose = Callable[[torch.Tensor, int], torch.Tensor]  # (a draft slot's logits [S, vocab] fp32, slot) -> ids [S]


def greedy(logits: torch.Tensor, slot: int) -> torch.Tensor:
    """Each row's first highest-scoring token (ties to the lowest id)."""
    return torch.argmax(logits, dim=-1)


class DraftDecoder(Decoder):
    """A draft model (V4's MTP block, V4.1's DSpark): it runs on its target's embedding and head (a
    checkpoint stores them once, for the target), which `share` hands it."""

    _shared: tuple[nn.Embedding, Linear] | None = None

    @property
    def max_drafts(self) -> int | None:
        """The most tokens this draft model proposes per sequence and step (a larger `draft_tokens` is
        refused); None: no bound of its own (V4's MTP block chains one pass per token)."""
        return None

    def share(self, target: Decoder) -> None:
        """Use `target`'s embedding and head."""
        self._shared = (target.embed, target.head)

    @property
    def embed(self) -> nn.Embedding:
        return self._target_part(0)

    @property
    def head(self) -> Linear:
        return self._target_part(1)

    def _target_part(self, index: int) -> nn.Module:
        if self._shared is None:
            raise RuntimeError(f"{type(self).__name__}.share(target) first: the draft uses the target's "
                               "embedding and head")
        return self._shared[index]
