import torch

from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config
from deepinfer.model.batch import NULL_BLOCK, PoolSpec, StepBatch, bucket
from deepinfer.model.transformer import Decoder, DeepseekV4
from deepinfer.model.transformer_v41 import DeepseekV41
from deepinfer.kernels import Ops


def build_model(config: ModelConfig | V41Config, ops: Ops, dtype: torch.dtype, device: torch.device | str = "meta",
                cache_qdq: bool = True, engram_on_host: bool = False) -> Decoder:
    """The model its config describes: `DeepseekV41` for a V4.1 config (with the release's cache formats
    unless `cache_qdq` is false, its Engram tables in host memory with `engram_on_host`), `DeepseekV4`
    otherwise."""
    if isinstance(config, V41Config):
        return DeepseekV41(config, ops, dtype, device=device, cache_qdq=cache_qdq, engram_on_host=engram_on_host)
    return DeepseekV4(config, ops, dtype, device=device)


__all__ = ["Decoder", "DeepseekV4", "DeepseekV41", "NULL_BLOCK", "PoolSpec", "StepBatch", "bucket", "build_model"]
