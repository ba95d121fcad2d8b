from deepinfer.model.batch import NULL_BLOCK, PoolSpec, StepBatch, bucket
from deepinfer.model.transformer import Decoder, DeepseekV4
from deepinfer.model.transformer_v41 import DeepseekV41

__all__ = ["Decoder", "DeepseekV4", "DeepseekV41", "NULL_BLOCK", "PoolSpec", "StepBatch", "bucket"]
