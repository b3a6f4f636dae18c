"""Load a Hugging Face decoder and its tokenizer from a local directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from sparse_engine.model.arch import LayerParts, find_layers
from sparse_engine.model.chat import bos_prefix, ensure_template
from sparse_engine.model.model_dir import pruned_entry, weights_sha256
from sparse_engine.model.surgery import resize_mlps

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

    @property
    def bos_prefix(self) -> tuple[int, ...]:
        """What the tokenizer puts before any text; scoring prepends it (`chat.bos_prefix`)."""
        return bos_prefix(self.tokenizer)


def load_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    log.info("loading model from %s", model_dir)
    pruned = pruned_entry(model_dir)
    if pruned is not None:
        model = _load_pruned(model_dir, pruned, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ensure_template(tokenizer, model_dir.name)
    return wrap(model, tokenizer, model_dir.name, weights_sha256(model_dir))


def wrap(model: PreTrainedModel, tokenizer: Any, model_id: str, sha256: str) -> LoadedModel:
    model.eval()
    return LoadedModel(model, tokenizer, find_layers(model), model_id, sha256)


def _load_pruned(model_dir: Path, entry: dict[str, Any], dtype: torch.dtype) -> Any:
    """Build the model from its config, give each layer its pruned MLP shapes, then load the
    weights strictly (tied output embeddings aside)."""
    from safetensors.torch import load_file

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    sizes = [int(n) for n in entry["intermediate_sizes"]]
    resize_mlps(find_layers(model), sizes, {int(i) for i in entry.get("down_bias_layers", [])})
    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = set(result.missing_keys) - _tied_names(model)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{model_dir} does not match its pruned sizes: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}; prune it again"
        )
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.to(dtype)


def _tied_names(model: Any) -> set[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    head = model.get_output_embeddings()
    return {f"{name}.weight" for name, module in model.named_modules() if module is head}
