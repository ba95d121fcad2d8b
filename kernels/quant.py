"""Number formats of the DeepSeek-V4.1-Flash release, in plain PyTorch (CPU or CUDA).

Every scale here is either a power of two or an FP8 number, applied to a small group of
neighbouring values:

- E8M0 is a bare exponent byte: byte b means 2^(b - 127) (0 means 2^-127, 255 is NaN). Scales
  may also arrive as raw `uint8` bytes; we read those as E8M0.
- E4M3 (`float8_e4m3fn`) has 3 mantissa bits, no infinity and a largest value of 448.
- E2M1 (FP4) has the eight magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: code c in 0..7 is magnitude c,
  and c + 8 its negation. Two codes share a byte, the even column in the low nibble.

Weights (decoding is exact: an FP8 or FP4 value times a power of two is an fp32 number, unless
it overflows to inf):

- FP8 block: E4M3 weight [out, in] and one E8M0 scale per `block` x `block` tile (32 in V4.1,
  128 in V4; V4's FP8-expert checkpoints carry float32 scales instead).
- MXFP4: packed E2M1 [out, in / 2] and one E8M0 scale per row and 32 columns.

`QuantizedWeight` holds such a weight (or a stack of them) as stored, for kernels that decode it
tile by tile (kernels/triton_ops.py); the PyTorch ops take it through `accepts_quantized`.

Caches: the reference model stores four activations in low precision, and simulates that by
quantizing and dequantizing them ("QDQ") in its forward; to match it an engine must do the same,
bit for bit (NeMo AutoModel 0.7.0's `quantize_cache`). Each function works on the last
dimension in groups of `group_size` (a short last group is padded with zeros) and returns the
input's dtype:

- `fp8_ue8m0_qdq`: window KV, E4M3 with a power-of-two scale per 32 channels;
- `nvfp4_qdq`: compressed KV, E2M1 with an E4M3 scale per 16 channels. There is no per-tensor
  scale, so a group's scale saturates at 448 and values beyond 6 * 448 = 2688 saturate too;
- `mxfp4_qdq`: indexer queries and keys, E2M1 with a power-of-two scale per 32 channels.

A group's result depends on that group alone, so rows never influence each other. Finite
inputs give the same bits on CPU and CUDA; for groups holding inf or NaN the results follow the
reference on the same device, and the two devices differ there (the NaNs the hardware makes
carry different signs and payloads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP4_GROUP = 32

# Between consecutive E2M1 magnitudes; midpoint i separates code i from code i + 1.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# The reference multiplies by these rounded fp32 reciprocals. Above the amax floors that picks
# the same power of two as dividing would (checked over whole binades), but we keep its form.
_INV_E4M3_MAX = 1 / E4M3_MAX
_INV_E2M1_MAX = 1 / E2M1_MAX
# Floors on a group's largest magnitude (the reference's): they keep every scale positive.
_FP8_AMAX_FLOOR = 1e-4
_MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126
_NVFP4_AMAX_FLOOR = E2M1_MAX * 2.0**-9  # scale 2^-9, the smallest E4M3 number


# ---------------------------------------------------------------------------------------------
# Cache quantize-dequantize
# ---------------------------------------------------------------------------------------------


def fp8_ue8m0_qdq(x: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """Round `x` [..., D] to E4M3 times a power-of-two scale per group (window KV cache).

    The scale is the power of two at or above amax * (1/448), amax floored at 1e-4. Zeros keep
    their sign. A group holding +-inf comes back all NaN. In a group holding NaN the scale's
    bits come out as -0.0: NaNs and zeros become NaN, other values zeros of their own sign.
    """
    groups = _grouped("fp8_ue8m0_qdq", x, group_size)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = _pow2_at_or_above(amax.clamp_min(_FP8_AMAX_FLOOR) * _INV_E4M3_MAX)
    # Finite groups never exceed 448 here. In a NaN group (scale -0.0) values become +-inf, which
    # the clamp saturates on every PyTorch version, as NeMo's cast does on 2.13.
    values = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return _ungrouped(values * scale, x)


def mxfp4_qdq(x: torch.Tensor, group_size: int = MXFP4_GROUP) -> torch.Tensor:
    """Round `x` [..., D] to E2M1 times a power-of-two scale per group (indexer queries and keys).

    The scale is the power of two at or above amax * (1/6), amax floored at 6 * 2^-126; values
    round to the nearest E2M1 magnitude, ties to the even code. A group holding +-inf comes back
    NaN, except that the infinities become inf signed like the NaN the hardware makes for
    inf / inf (-inf on x86 CPUs). A group holding NaN comes back as signed zeros, NaNs included.
    """
    groups = _grouped("mxfp4_qdq", x, group_size)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = _pow2_at_or_above(amax.clamp_min(_MXFP4_AMAX_FLOOR) * _INV_E2M1_MAX)
    return _ungrouped(_e2m1_round(groups, scale), x)


def nvfp4_qdq(x: torch.Tensor, group_size: int = 16) -> torch.Tensor:
    """Round `x` [..., D] to E2M1 times an E4M3 scale per group (compressed KV cache).

    The scale is amax / 6 rounded to E4M3 (amax floored at 6 * 2^-9, the scale capped at 448);
    values round to the nearest E2M1 magnitude, ties to the even code, saturating at 6 * scale,
    so +-inf becomes +-2688 when the group is otherwise finite. A group holding NaN is all NaN.
    """
    groups = _grouped("nvfp4_qdq", x, group_size)
    amax = groups.abs().amax(-1, keepdim=True)
    # PyTorch 2.13 saturates E4M3 casts (NeMo's result in the dev install); 2.11 gives NaN
    # instead. The cap gives the saturated scale on every version.
    scale = (amax.clamp_min(_NVFP4_AMAX_FLOOR) / E2M1_MAX).clamp_max(E4M3_MAX)
    return _ungrouped(_e2m1_round(groups, scale.to(torch.float8_e4m3fn).float()), x)


def _grouped(caller: str, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 view of x [..., D] as [..., ceil(D / group_size), group_size], zero-padded."""
    if group_size <= 0:
        raise ValueError(f"{caller}: group_size must be positive, got {group_size}")
    padded = F.pad(x.float(), (0, -x.shape[-1] % group_size))
    return padded.unflatten(-1, (-1, group_size))


def _ungrouped(groups: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return groups.flatten(-2)[..., : like.shape[-1]].to(like.dtype)


def _pow2_at_or_above(x: torch.Tensor) -> torch.Tensor:
    """The power of two at or above each positive fp32 value, from its bits.

    Adding 2^23 - 1 carries into the exponent exactly when the mantissa is nonzero; masking
    then drops the mantissa. inf stays inf. NaN carries into the sign bit and gives -0.0, which
    is what the reference's own bit arithmetic yields, so we keep it.
    """
    magnitude = x.contiguous().view(torch.int32) & 0x7FFFFFFF
    return ((magnitude + 0x7FFFFF) & -0x800000).view(torch.float32)


def _e2m1_round(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """groups / scale rounded to E2M1 (ties to even, saturating at 6), times scale again."""
    scaled = (groups / scale).clamp(-E2M1_MAX, E2M1_MAX)
    magnitude = _e2m1_magnitude(_e2m1_code(scaled.abs(), ties_to_even=True))
    return torch.copysign(magnitude, scaled) * scale


def _e2m1_code(magnitude: torch.Tensor, *, ties_to_even: bool) -> torch.Tensor:
    """Code 0..7 of the E2M1 magnitude nearest each (non-negative) value, as int32.

    The code counts the midpoints the value lies beyond. On a midpoint it goes up when that
    gives the even code (`ties_to_even`), else it stays down. NaN lies beyond every midpoint
    (code 7), as `torch.bucketize` places it in the reference.
    """
    code = torch.zeros(magnitude.shape, dtype=torch.int32, device=magnitude.device)
    for index, midpoint in enumerate(_E2M1_MIDPOINTS):
        up_on_tie = ties_to_even and index % 2 == 1
        stays = magnitude < midpoint if up_on_tie else magnitude <= midpoint
        code += (~stays).int()
    return code


def _e2m1_magnitude(code: torch.Tensor) -> torch.Tensor:
    """fp32 magnitude of E2M1 codes 0..7: 1.m * 2^(e - 1), or 0.m for e = 0 (in quarters)."""
    exponent, mantissa = code >> 1, code & 1
    quarters = torch.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)
    return quarters.float() * 0.25


# ---------------------------------------------------------------------------------------------
# Checkpoint weights
# ---------------------------------------------------------------------------------------------


def fp8_block_decode(weight: torch.Tensor, scale: torch.Tensor, block: int | tuple[int, int] = 32) -> torch.Tensor:
    """E4M3 weight [out, in] times its per-tile scale [ceil(out/rows), ceil(in/cols)] -> fp32, for
    tiles of `block` = rows x cols (an int: square; V4.1's Engram tables use (1, 32), a scale per row
    and 32 columns).

    `scale` is E8M0 (or its raw uint8 bytes), or float32 as in V4's FP8-expert checkpoints.
    """
    _check_dtype("fp8_block_decode", "weight", weight, (torch.float8_e4m3fn,))
    _check_2d("fp8_block_decode", weight)
    block = _tile(block)
    _check_block("fp8_block_decode", min(block))
    _check_dtype("fp8_block_decode", "scale", scale, (torch.float8_e8m0fnu, torch.uint8, torch.float32))
    rows, cols = weight.shape
    tiles = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != tiles:
        raise ValueError(
            f"fp8_block_decode: scale shape {list(scale.shape)} does not match {list(tiles)} "
            f"(weight {list(weight.shape)} in {block[0]}x{block[1]} tiles)"
        )
    return weight.float() * _tile_scales(_scale_values(scale), block, rows, cols)


def fp8_block_encode(weight: torch.Tensor, block: int | tuple[int, int] = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [out, in] -> (E4M3 weight, E8M0 scale [ceil(out/rows), ceil(in/cols)]) for tiles of
    `block` = rows x cols (an int: square).

    Each tile's scale is the smallest power of two that brings its largest magnitude to 448 or
    less, worked out exactly from that magnitude's exponent and mantissa, so the output of
    `fp8_block_decode` encodes back to the same values (whatever its scales, as long as its
    values are finite and not NaN). A tile that is all zeros, or holds inf or NaN, gets 2^-9,
    the scale of a largest magnitude of 0.5; its values are quantized with it, inf saturating
    at 448 and NaN staying NaN. NeMo writes no FP8 weights, so there is no byte layout to
    match: this is the power-of-two-at-or-above rule of NeMo's cache FP8, made exact, with
    its MXFP4 writer's treatment of zero tiles (frexp's exponent 0).
    """
    _check_2d("fp8_block_encode", weight)
    _check_floating("fp8_block_encode", weight)
    block = _tile(block)
    _check_block("fp8_block_encode", min(block))
    rows, cols = weight.shape
    padded = F.pad(weight.float(), (0, -cols % block[1], 0, -rows % block[0]))
    amax = padded.unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0])).abs().amax(dim=(1, 3))
    mantissa, exponent = torch.frexp(_finite_or_zero(amax))
    # amax = m * 2^e with m in [0.5, 1), and 448 = 0.875 * 2^9: the smallest k with
    # amax / 2^k <= 448 is e - 9, or e - 8 when m > 0.875. The byte is k + 127.
    byte = (exponent + 118 + (mantissa > 0.875).int()).clamp(0, 254)
    scale = byte.to(torch.uint8).view(torch.float8_e8m0fnu)
    values = weight.float() / _tile_scales(scale.float(), block, rows, cols)
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [..., in/2] (int8 or uint8) times E8M0 scales [..., ceil(in/32)] -> fp32.

    Code 8 (negative zero) decodes as +0.0, as in the reference's table.
    """
    _check_dtype("mxfp4_decode", "packed", packed, (torch.int8, torch.uint8))
    _check_dtype("mxfp4_decode", "scale", scale, (torch.float8_e8m0fnu, torch.uint8))
    if packed.ndim == 0:
        raise ValueError("mxfp4_decode: packed must have at least one dimension")
    cols = 2 * packed.shape[-1]
    expected = (*packed.shape[:-1], -(-cols // MXFP4_GROUP))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"mxfp4_decode: scale shape {list(scale.shape)} does not match {list(expected)} "
            f"(one per {MXFP4_GROUP} columns of packed {list(packed.shape)})"
        )
    raw = packed.view(torch.uint8)
    code = torch.stack((raw & 15, raw >> 4), dim=-1).flatten(-2).int()
    magnitude = _e2m1_magnitude(code & 7)
    values = torch.where((code & 8) != 0, 0.0 - magnitude, magnitude)
    factor = _scale_values(scale).unsqueeze(-1).expand(*expected, MXFP4_GROUP).flatten(-2)
    return values * factor[..., :cols]


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [..., in] -> (packed E2M1 int8 [..., in/2], E8M0 scale [..., in/32]).

    Byte for byte what NeMo's MXFP4 writer (`quantize_mxfp4`) produces. The scale exponent is
    floor(log2(amax)) - 2, kept within bytes 1..254: values already E2M1 times such a scale
    round-trip exactly, and the largest magnitude of other groups may saturate at 6. Values
    round to the nearest magnitude with ties toward zero; -0.0 and NaN get positive codes, NaN
    and +-inf code 7 (6). A group that is all zeros or holds inf or NaN gets byte 124 (2^-3).
    """
    _check_floating("mxfp4_encode", weight)
    if weight.ndim == 0 or weight.shape[-1] % MXFP4_GROUP:
        raise ValueError(
            f"mxfp4_encode: last dimension must be a multiple of {MXFP4_GROUP}, got shape {list(weight.shape)}"
        )
    groups = weight.float().unflatten(-1, (-1, MXFP4_GROUP))
    _, exponent = torch.frexp(_finite_or_zero(groups.abs().amax(-1)))
    # amax < 2^exponent and E2M1 reaches 6 < 2^3: the scale is 2^(exponent - 3).
    scale = (exponent + 124).clamp(1, 254).to(torch.uint8).view(torch.float8_e8m0fnu)
    code = _e2m1_code(groups.abs() / scale.float().unsqueeze(-1), ties_to_even=False)
    code = (code | ((groups < 0).int() << 3)).flatten(-2).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).view(torch.int8), scale


_DATA_DTYPES = {"fp8": (torch.float8_e4m3fn,), "mxfp4": (torch.int8, torch.uint8)}
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight [..., N, K] (a stack of them, for experts) kept as the checkpoint stores it, so that it
    fits in memory where its decoded values would not; kernels decode it tile by tile.

    `data` is E4M3 [..., N, K] ("fp8") or packed E2M1 [..., N, K / 2] ("mxfp4"); `scale` holds the E8M0
    scales (or their uint8 bytes) [..., ceil(N / tile[0]), ceil(K / tile[1])]; `tile` is (32, 32) for
    V4.1's dense weights, (128, 128) for V4's, (1, 32) for MXFP4 and the Engram tables. Its values are
    `decode()`'s: exact fp32 values cast to `dtype`, the dtype the matmuls compute in.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    tile: tuple[int, int]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self._check_formats()
        if self.data.ndim < 2:
            raise ValueError(f"QuantizedWeight: data must be [..., N, K], got shape {list(self.data.shape)}")
        *lead, rows, cols = self.shape
        expected = [*lead, -(-rows // self.tile[0]), -(-cols // self.tile[1])]
        if list(self.scale.shape) != expected:
            raise ValueError(
                f"QuantizedWeight: scale shape {list(self.scale.shape)} does not match {expected} "
                f"(weight {list(self.shape)} in {self.tile[0]}x{self.tile[1]} tiles)"
            )
        if self.scale.device != self.data.device:
            raise ValueError(f"QuantizedWeight: scale is on {self.scale.device}, data on {self.data.device}")

    def _check_formats(self) -> None:
        if self.fmt not in _DATA_DTYPES:
            raise ValueError(f"QuantizedWeight: fmt must be fp8 or mxfp4, got {self.fmt!r}")
        _check_dtype("QuantizedWeight", "data", self.data, _DATA_DTYPES[self.fmt])
        _check_dtype("QuantizedWeight", "scale", self.scale, _SCALE_DTYPES)
        if self.dtype not in _COMPUTE_DTYPES:
            dtype = str(self.dtype).removeprefix("torch.")
            raise ValueError(f"QuantizedWeight: dtype must be float32 or bfloat16, got {dtype}")
        tile = self.tile
        if not (isinstance(tile, tuple) and len(tile) == 2 and all(isinstance(n, int) and n > 0 for n in tile)):
            raise ValueError(f"QuantizedWeight: tile must be a tuple of two positive ints, got {tile!r}")
        if self.fmt == "mxfp4" and tile != (1, MXFP4_GROUP):
            raise ValueError(f"QuantizedWeight: mxfp4 tile must be (1, {MXFP4_GROUP}), got {tile}")

    @property
    def shape(self) -> torch.Size:
        """The logical shape [..., N, K] (packed MXFP4 data has K / 2 columns)."""
        packing = 2 if self.fmt == "mxfp4" else 1
        return torch.Size((*self.data.shape[:-1], packing * self.data.shape[-1]))

    def decode(self) -> torch.Tensor:
        """The exact fp32 values (the decoders the loader uses) cast to `dtype`."""
        if self.fmt == "mxfp4":
            return mxfp4_decode(self.data, self.scale).to(self.dtype)
        *lead, rows, cols = self.shape
        data, scale = self.data.reshape(-1, rows, cols), self.scale.reshape(-1, *self.scale.shape[-2:])
        matrices = [fp8_block_decode(d, s, self.tile).to(self.dtype) for d, s in zip(data, scale)]
        return torch.stack(matrices).view(*lead, rows, cols)

    def __getitem__(self, index: int) -> QuantizedWeight:
        """Weight `index` of a stack [E, N, K] (one expert)."""
        if self.data.ndim < 3:
            raise ValueError(f"QuantizedWeight: only a stack [E, N, K] can be indexed, got shape {list(self.shape)}")
        return replace(self, data=self.data[index], scale=self.scale[index])

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return replace(self, data=self.data.to(device), scale=self.scale.to(device))

    @classmethod
    def stack(cls, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """[E, N, K] from E weights [N, K] of one format, tile, dtype and shape (the routed experts)."""
        first = _same_kind("stack", weights)
        if any(w.shape != first.shape for w in weights):
            raise ValueError(f"QuantizedWeight.stack: shapes differ: {[list(w.shape) for w in weights]}")
        data = torch.stack([w.data for w in weights])
        return replace(first, data=data, scale=torch.stack([w.scale for w in weights]))

    @classmethod
    def cat(cls, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The weights' rows one after the other, [..., N1 + N2 + ..., K] (w13 from w1 and w3). Every part
        but the last must end on a tile boundary, or a scale row would cover two parts' rows."""
        first = _same_kind("cat", weights)
        if any(w.shape[:-2] != first.shape[:-2] or w.shape[-1] != first.shape[-1] for w in weights):
            raise ValueError(f"QuantizedWeight.cat: shapes differ beyond rows: {[list(w.shape) for w in weights]}")
        tile_rows = first.tile[0]
        for part, weight in enumerate(weights[:-1]):
            if weight.shape[-2] % tile_rows:
                rows = weight.shape[-2]
                raise ValueError(f"QuantizedWeight.cat: part {part} has {rows} rows, not a multiple of {tile_rows}")
        data = torch.cat([w.data for w in weights], dim=-2)
        return replace(first, data=data, scale=torch.cat([w.scale for w in weights], dim=-2))


def _same_kind(caller: str, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The first of `weights`, checked to share format, tile, dtype and storage dtypes with the others."""
    if not weights:
        raise ValueError(f"QuantizedWeight.{caller}: no weights")
    if len({(w.fmt, w.tile, w.dtype, w.data.dtype, w.scale.dtype) for w in weights}) > 1:
        raise ValueError(f"QuantizedWeight.{caller}: weights differ in format, tile, dtype or storage dtypes")
    return weights[0]


def accepts_quantized(op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`op(x, weight, ...)` taking a QuantizedWeight too, decoded before the call: PyTorch ops have no
    quantized kernels, and decoding is exact, so the bits are those of `op` on `weight.decode()`."""

    @functools.wraps(op)
    def call(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, *args, **kwargs) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            weight = weight.decode()
        return op(x, weight, *args, **kwargs)

    return call


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 value of each scale; uint8 holds E8M0 bytes."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float()


def _tile(block: int | tuple[int, int]) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else tuple(block)


def _tile_scales(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Per-tile scales [R, C] spread over the [rows, cols] elements they cover."""
    tiles_r, tiles_c = scale.shape
    spread = scale[:, None, :, None].expand(tiles_r, block[0], tiles_c, block[1])
    return spread.reshape(tiles_r * block[0], tiles_c * block[1])[:rows, :cols]


def _check_dtype(caller: str, name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = [str(dtype).removeprefix("torch.") for dtype in allowed]
        names = " or ".join((", ".join(names[:-1]), names[-1])) if len(names) > 1 else names[0]
        raise ValueError(f"{caller}: {name} dtype must be {names}, got {str(tensor.dtype).removeprefix('torch.')}")


def _check_floating(caller: str, weight: torch.Tensor) -> None:
    if not weight.is_floating_point():
        raise ValueError(f"{caller}: weight must be floating point, got {str(weight.dtype).removeprefix('torch.')}")


def _check_2d(caller: str, weight: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise ValueError(f"{caller}: weight must be 2-D, got shape {list(weight.shape)}")


def _check_block(caller: str, block: int) -> None:
    if block <= 0:
        raise ValueError(f"{caller}: block must be positive, got {block}")
