from deepinfer.errors import DeepInferError


class CheckpointError(DeepInferError, ValueError):
    """A checkpoint folder that cannot be created or loaded."""
