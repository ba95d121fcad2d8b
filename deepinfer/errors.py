"""The one error family users see: every message is a single line that names the problem."""


class DeepInferError(Exception):
    """Base class for errors caused by bad input (files, flags, prompts, parameters)."""
