"""What the engine asks of a model family (`Family`): one subclass per family, registered by its
config.json `model_type` (`deepinfer.families`). Code outside the families asks a config's family
instead of testing the config's type, so a new family touches no engine file."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer.families.tensor_spec import TensorSpec
from deepinfer.errors import DeepInferError
from deepinfer.kernels import Ops


class Family:
    """A model family: its config class and, for its configs, the checkpoint's tensors, how they are
    held in memory, the model, and the draft model the family speculates with (`speculation`, None
    without one). The defaults are a family with no quantized formats, no optional tensors and no
    draft model."""

    model_type: str
    config_class: type
    name: str  # in messages: "V4"
    speculation: str | None = None  # the `speculation` mode that runs the family's draft model
    draft_name = "draft layers"  # what checkpoints call the draft model's `mtp.*` tensors, in messages
    encoding: str | None = None  # the official prompt encoding (deepinfer.recipe.official.ENCODINGS), if any

    # the checkpoint --------------------------------------------------------------------------------

    def expected_tensors(self, config, include_mtp: bool) -> dict[str, TensorSpec]:
        """Every tensor of a checkpoint of `config`, as it stores them; `include_mtp` adds the draft's."""
        raise NotImplementedError

    def unchecked_tensor(self, config, name: str) -> bool:
        """A tensor a checkpoint may hold that `expected_tensors` does not describe."""
        return False

    def unused_tensor(self, config, name: str) -> bool:
        """A tensor a checkpoint may hold that the engine leaves unused."""
        return False

    def weights_in_memory(self, config, tensors: dict[str, torch.Tensor], quantized_as: torch.dtype | None) -> dict:
        """Stored tensors as the engine takes them: decoded, or (`quantized_as`) kept quantized where
        the family's kernels take them so."""
        return tensors

    def quantized_formats(self, config, weight_dtype: str) -> dict[str, str]:
        """How a config with a `quantization_config` stores its parts (number format, tile, scales)."""
        raise DeepInferError(f"{self.name} checkpoints have no quantized formats")

    def encode_random(self, config, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor] | None:
        """Random plain tensors of `config` encoded as its checkpoint stores them, or None when it
        stores them as generated."""
        return None

    def released_format(self, config):
        """`config` declaring the formats the family's released checkpoints are stored in (None: the
        family has no released quantized format)."""
        return None

    def has_draft(self, config) -> bool:
        """Whether `config` declares draft layers (the checkpoint may still leave them out)."""
        return False

    # the model ---------------------------------------------------------------------------------

    def build_model(self, config, ops: Ops, dtype: torch.dtype, device: torch.device | str = "meta",
                    cache_qdq: bool = True, engram_on_host: bool = False):
        """The model, its weights not loaded, with `deepinfer.model.Decoder`'s interface: `pools`,
        `placement(name, device)` (where each tensor is read to and kept), `load_tensors`, the forward
        and `logits`."""
        raise NotImplementedError

    def use_tokenizer(self, model, tokenizer) -> None:
        """Give a loaded model the checkpoint's tokenizer where its forward needs one (None: it has none)."""

    def new_draft(self, config, ops: Ops, dtype: torch.dtype, device: torch.device, cache_qdq: bool):
        """The family's draft model for `config`, its weights not loaded."""
        raise DeepInferError(f"{self.name} has no draft model")

    def draft_pools(self, pools: list, draft) -> list:
        """A target's cache pools with room for `draft`'s KV."""
        raise NotImplementedError

    def draft_runner(self, draft, cache, draft_tokens: int, threshold: float):
        """What runs `draft` on the device inside engine steps (`engine.draft_runner.DeviceDrafts`)."""
        raise NotImplementedError

    def architecture_lines(self, config) -> list[str]:
        """`deepinfer checkpoint info`'s lines on the model: family, layer schedule, attention."""
        return [f"model       {self.name} ({self.model_type})"]
