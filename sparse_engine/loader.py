"""Load a Hugging Face decoder and its tokenizer from a local directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from sparse_engine.arch import LayerParts, find_layers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any
    layers: list[LayerParts]
    model_id: str
    weights_sha256: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    from sparse_engine.models import weights_sha256

    log.info("loading model from %s", model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return wrap(model, tokenizer, model_dir.name, weights_sha256(model_dir))


def wrap(model: PreTrainedModel, tokenizer: Any, model_id: str, sha256: str) -> LoadedModel:
    model.eval()
    return LoadedModel(model, tokenizer, find_layers(model), model_id, sha256)
