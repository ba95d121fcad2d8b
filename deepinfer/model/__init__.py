from deepinfer.model.batch import CompressorStep, StepBatch
from deepinfer.model.transformer import DeepseekV4

__all__ = ["CompressorStep", "DeepseekV4", "StepBatch"]
