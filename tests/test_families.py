"""Model families are units of the code: the engine knows a family only through the registry keyed by
config.json's `model_type` (deepinfer/families). A toy third family defined in this file alone (a
bigram model: its config, its tensor layout, a model of one MLP layer) is served by `LLM.generate`
from a checkpoint folder: its greedy continuations are the argmax chain computed from its weights by
hand, the same bits in a batch as alone, and the loader checks its tensors as it checks the others'."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint import CheckpointError, load_checkpoint
from deepinfer.families import registry
from deepinfer.families.base import Family
from deepinfer.families.tensor_spec import WEIGHT, TensorSpec
from deepinfer.families.v4.config import ConfigError
from deepinfer.model import PoolSpec

VOCAB, HIDDEN = 64, 16
LIMIT = 1e9  # the SwiGLU clamp, out of reach


@dataclass
class BigramConfig:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int = 256
    eos_token_id: int = 1
    model_type: str = "toy_bigram"
    quantization_config: None = None
    n_routed_experts: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.eos_token_id]

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> BigramConfig:
        missing = [name for name in ("vocab_size", "hidden_size") if name not in raw]
        if missing:
            raise ConfigError(f"{source}: required field '{missing[0]}' is missing")
        return cls(raw["vocab_size"], raw["hidden_size"])


class BigramModel(nn.Module):
    """The next token from the last one alone: one SwiGLU layer, head(silu(gate x) * up x) with
    x = embed[token], through the numerics table's batch-invariant ops. It declares one window pool
    and reads no cache rows."""

    engram_tokens, engram_on_host, context = None, False, None

    def __init__(self, config: BigramConfig, ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops, self.config = ops, config
        for name, spec in Bigram().expected_tensors(config, False).items():
            self.register_parameter(name, nn.Parameter(torch.empty(spec.shape, dtype=dtype, device="meta"),
                                                       requires_grad=False))
        self.pools = [PoolSpec("window", "window", (0,), config.hidden_size, window=8)]

    def placement(self, name: str, device):
        return device  # every tensor on the engine's device

    def load_tensors(self, tensors: dict, device) -> None:
        for name in list(self._parameters):
            value = tensors.pop(name).to(device)
            self._parameters[name] = nn.Parameter(value if name == "embed" else self.ops.matmul_layout(value),
                                                  requires_grad=False)

    def forward(self, batch, caches, streams_at=None) -> torch.Tensor:
        x = self.embed[batch.input_ids]
        hidden = self.ops.clamped_swiglu(self.ops.linear(x, self.gate), self.ops.linear(x, self.up), LIMIT)
        return hidden if batch.sample_index is None else hidden[batch.sample_index]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.head).float()


class Bigram(Family):
    model_type, config_class, name = "toy_bigram", BigramConfig, "toy bigram"

    def expected_tensors(self, config: BigramConfig, include_mtp: bool) -> dict[str, TensorSpec]:
        h, v = config.hidden_size, config.vocab_size
        return {"embed": TensorSpec((v, h), WEIGHT), "gate": TensorSpec((h, h), WEIGHT),
                "up": TensorSpec((h, h), WEIGHT), "head": TensorSpec((v, h), WEIGHT)}

    def build_model(self, config, ops, dtype, device="meta", cache_qdq=True, engram_on_host=False) -> BigramModel:
        return BigramModel(config, ops, dtype)


@pytest.fixture
def bigram(tmp_path, monkeypatch):
    """The toy family registered (for this test only) and a checkpoint of it: (folder, weights)."""
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    registry.register_family(Bigram())
    gen = torch.Generator().manual_seed(3)
    weights = {"embed": torch.randn(VOCAB, HIDDEN, generator=gen), "gate": torch.randn(HIDDEN, HIDDEN, generator=gen) / 4,
               "up": torch.randn(HIDDEN, HIDDEN, generator=gen) / 4, "head": torch.randn(VOCAB, HIDDEN, generator=gen)}
    folder = tmp_path / "bigram"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toy_bigram", "vocab_size": VOCAB,
                                                    "hidden_size": HIDDEN}))
    save_file(dict(weights), folder / "model.safetensors")
    return folder, weights


def by_hand(weights: dict, token: int, steps: int) -> list[int]:
    """The greedy bigram chain from `token`, in float64."""
    chain = []
    for _ in range(steps):
        x = weights["embed"][token].double()
        hidden = torch.nn.functional.silu(weights["gate"].double() @ x) * (weights["up"].double() @ x)
        token = int(torch.argmax(weights["head"].double() @ hidden))
        chain.append(token)
    return chain


def test_a_family_registered_alone_is_served_by_generate(bigram):
    folder, weights = bigram
    llm = LLM(folder, max_num_seqs=4)
    prompts = [[5, 9, 2], [7], [3, 3, 3, 3, 40], [11, 12]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = llm.generate(prompts, greedy)
    assert [out.token_ids for out in together] == [by_hand(weights, p[-1], 6) for p in prompts]
    alone = [llm.with_engine(llm.engine_config).generate([p], greedy)[0] for p in prompts]
    assert [(a.token_ids, a.logprobs) for a in alone] == [(t.token_ids, t.logprobs) for t in together]
    assert llm.host.family.name == "toy bigram" and llm.config.model_type == "toy_bigram"


def test_the_loader_checks_a_registered_familys_tensors(bigram):
    folder, weights = bigram
    save_file({**weights, "head": weights["head"][:, :8].contiguous()}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"^head: shape \(64, 8\) does not match config \(64, 16\)$"):
        load_checkpoint(folder)


def test_an_unregistered_model_type_is_named_with_the_registered_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy_bigram"}))
    with pytest.raises(ConfigError, match="model_type is 'toy_bigram', expected one of 'deepseek_v4', 'deepseek_v41'$"):
        load_checkpoint(tmp_path)
