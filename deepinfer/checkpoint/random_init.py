"""Seeded random weights for synthetic checkpoints.

Every tensor comes from a counter-based integer hash keyed by (seed, tensor name), evaluated with
plain int64/fp32 torch ops. So a tensor does not depend on generation order or sharding, and the
bits are the same whether it is built on a CPU or straight on a GPU (stateful torch generators
differ between devices).

Scales keep the random network healthy and decisive: matrices are uniform with std 1/sqrt(fan_in),
so every projection roughly preserves the RMS of its input; norm weights are 1 ± small noise; the
hyper-connection mixing logits have unit spread so the Sinkhorn-normalised stream mixing is far from
both identity and uniform; the head gain sets the logit spread.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import torch

from deepinfer.checkpoint.layout import expected_tensors
from deepinfer.families.tensor_spec import FP32, INDEX, TensorSpec
from deepinfer.families.registry import family_of
from deepinfer.families.v4.config import ModelConfig
from deepinfer.families.v41.config import V41Config

EMBED_STD = 1.0
HEAD_GAIN = 3.0  # logits std ≈ HEAD_GAIN, since the final norm output has unit RMS
# (name suffix, mean, std) for tensors that are not plain fan-in-scaled matrices; first match wins.
_SPECIAL = (
    ("norm.weight", 1.0, 0.1),  # every RMSNorm weight incl. enorm/hnorm
    ("attn_sink", 0.0, 0.5),
    (".ape", 0.0, 0.1),
    ("gate.bias", 0.0, 0.1),
    ("confidence.bias", 0.0, 0.1),
    ("_base", 0.0, 0.5),  # hyper-connection biases: hc_attn_base, hc_ffn_base, hc_base, hc_head_base
    ("_scale", 1.0, 0.1),  # hyper-connection gains
    ("engram.q_weight", 1.0, 0.1),  # V4.1 Engram's per-stream gate weights (multiplied together)
    ("engram.k_weight", 1.0, 0.1),
)
_CHUNK = 1 << 22
_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd and < 2**27: x * _MUL never overflows int64 for 32-bit x


def random_tensors(config: ModelConfig, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                   include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """All checkpoint tensors; `dtype` applies to "weight" tensors (fp32/index kinds keep theirs)."""
    return dict(RandomTensors(config, seed, dtype, device, include_mtp))


def stored_random_tensors(config: ModelConfig | V41Config, seed: int, dtype: torch.dtype,
                          device: str | torch.device = "cpu", include_mtp: bool = True,
                          placement: Callable[[str], str | torch.device] | None = None) -> Mapping[str, torch.Tensor]:
    """The seeded tensors as a checkpoint of `config` stores them: `RandomTensors` of the plain model,
    encoded in the release's formats when the config declares V4.1's quantization (the plain tensors
    are generated one at a time, so only the encoded model is ever held whole)."""
    if config.quantization_config is None:
        return RandomTensors(config, seed, dtype, device, include_mtp, placement)
    plain = replace(config, quantization_config=None)
    encoded = family_of(config).encode_random(config, RandomTensors(plain, seed, dtype, device, include_mtp,
                                                                    placement))
    return encoded if encoded is not None else RandomTensors(config, seed, dtype, device, include_mtp, placement)


class RandomTensors(Mapping[str, torch.Tensor]):
    """`random_tensors` made lazy: a tensor is generated when looked up, so a writer can stream a
    big preset tensor by tensor; on `device`, or where `placement(name)` says (the values do not
    depend on the device: counter-based)."""

    def __init__(self, config: ModelConfig, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 include_mtp: bool = True, placement: Callable[[str], str | torch.device] | None = None):
        self._args = (config, seed)
        self._dtype, self._device, self._placement = dtype, device, placement
        self._specs = expected_tensors(config, include_mtp)

    def __getitem__(self, name: str) -> torch.Tensor:
        device = self._device if self._placement is None else self._placement(name)
        return random_tensor(*self._args, name, self._specs[name], self._dtype, device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def random_tensor(config: ModelConfig, seed: int, name: str, spec: TensorSpec, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    key = _key(seed, name)
    if spec.kind == INDEX:
        return _expert_table(key, spec.shape, config.n_routed_experts, device)
    mean, std = _init_scale(config, name, spec)
    u = _uniform(key, spec.numel, device).view(spec.shape)  # [-1, 1), std 1/sqrt(3)
    values = u * (std * math.sqrt(3.0))
    if mean:
        values = values + mean
    return values if spec.kind == FP32 else values.to(dtype)


def _init_scale(config: ModelConfig, name: str, spec: TensorSpec) -> tuple[float, float]:
    if name in ("model.embed_tokens.weight", "embed.weight"):
        return 0.0, EMBED_STD
    if name == "head.weight":
        return 0.0, HEAD_GAIN / math.sqrt(config.hidden_size)
    for suffix, mean, std in _SPECIAL:
        if name.endswith(suffix):
            return mean, std
    if len(spec.shape) != 2:
        raise ValueError(f"no init rule for {name} {spec.shape}")
    return 0.0, 1.0 / math.sqrt(spec.shape[1])


def _key(seed: int, name: str) -> tuple[int, int]:
    digest = hashlib.sha256(f"deepinfer-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection on 32-bit values (xorshift-multiply), computed in int64 without overflow."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def _bits(key: tuple[int, int], start: int, stop: int, device) -> torch.Tensor:
    """32 random bits per counter in [start, stop); distinct counters (< 2**32) give distinct values."""
    i = torch.arange(start, stop, dtype=torch.int64, device=device)
    return _mix32(_mix32((i & _M32) ^ key[0]) ^ (i >> 32) ^ key[1])


def _uniform(key: tuple[int, int], n: int, device) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.float32, device=device)
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        # 24 bits -> exact float32 in [0, 2); the shift to [-1, 1) is exact too.
        out[start:stop] = (_bits(key, start, stop, device) >> 8).to(torch.float32) * 2.0**-23 - 1.0
    return out


def _expert_table(key: tuple[int, int], shape: tuple[int, ...], n_experts: int, device) -> torch.Tensor:
    """Per token id, k distinct expert ids: the k smallest of n_experts distinct random keys."""
    vocab, k = shape
    rows = []
    step = max(1, _CHUNK // n_experts)
    for start in range(0, vocab, step):
        stop = min(vocab, start + step)
        bits = _bits(key, start * n_experts, stop * n_experts, device).view(stop - start, n_experts)
        rows.append(bits.argsort(dim=1)[:, :k])
    return torch.cat(rows).contiguous()
