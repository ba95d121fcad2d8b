from deepinfer.model.batch import NULL_BLOCK, PoolSpec, StepBatch, bucket
from deepinfer.model.transformer import DeepseekV4

__all__ = ["DeepseekV4", "NULL_BLOCK", "PoolSpec", "StepBatch", "bucket"]
