"""What every family's tensor layout is written in: a tensor's shape and storage kind."""

from __future__ import annotations

import math
from dataclasses import dataclass

WEIGHT, FP32, INDEX = "weight", "fp32", "index"
FP8, FP4, SCALE = "fp8", "fp4", "scale"  # quantized checkpoints: E4M3, packed E2M1 pairs, E8M0 scales
MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str  # WEIGHT: checkpoint dtype (fp32/bf16); FP32: always float32; INDEX: int64; FP8, FP4, SCALE
    # (quantized V4.1, and V4 in transformers' FP8 format): float8_e4m3fn, int8 holding two E2M1 codes,
    # float8_e8m0fnu (V4's float32 scales, `scale_fmt` "float", are FP32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
