"""What the model families share: step metadata and cache pools (`batch`), the decoder base classes
(`decoder`), layers, hyper-connections, MoE and rotary tables. Each family's model is in its package
under `deepinfer/families/`."""

from deepinfer.model.batch import NULL_BLOCK, PoolSpec, StepBatch, bucket
from deepinfer.model.decoder import Decoder

__all__ = ["Decoder", "NULL_BLOCK", "PoolSpec", "StepBatch", "bucket"]
