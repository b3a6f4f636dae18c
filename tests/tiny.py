"""Tiny random-init decoders (2 layers, hidden 64) with a byte-level tokenizer, for unit tests."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sparse_engine.calibration.allocation import thresholds_for, uniform_targets
from sparse_engine.calibration.stats import collect_stats
from sparse_engine.calibration.store import Calibration
from sparse_engine.model.loader import LoadedModel, wrap
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.prefix_cache import PrefixCache
from sparse_engine.sparsity.plan import Level, SparsityPlan

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<eos>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_model(family: str = "llama", seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    tokenizer = byte_tokenizer()
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    common: dict[str, Any] = {"vocab_size": vocab, "eos_token_id": eos, "bos_token_id": eos}
    llama_like: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    model: Any
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, **llama_like))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, **llama_like))
        for layer in model.model.layers:  # initialised to zero: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    elif family == "gemma3":
        # One sliding-window layer (8 positions, its own rotary base) and one global layer.
        layer_types = ["sliding_attention", "full_attention"]
        config = Gemma3TextConfig(
            **common, **llama_like, head_dim=16, sliding_window=8, layer_types=layer_types
        )
        model = Gemma3ForCausalLM(config)
    elif family == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(**common, n_embd=64, n_layer=2, n_head=4, n_positions=512)
        )
    else:
        raise ValueError(f"unknown tiny model family {family}")
    return wrap(model, tokenizer, f"tiny-{family}", f"tiny-{family}-{seed}")


SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Sparse activations skip work that would "
    "multiply by zero. Calibration picks thresholds so that a chosen share of inputs is "
    "zeroed. Held-out text measures what that costs in perplexity. "
)


def sample_texts(n: int = 12) -> list[str]:
    return [f"Document {i}. " + SAMPLE_TEXT * (1 + i % 3) for i in range(n)]


def tiny_engine(cache: bool = True, family: str = "llama") -> Engine:
    """A tiny model (Llama unless said) with conservative/balanced/aggressive plans at
    30/50/70 % sparsity."""
    lm = tiny_model(family)
    batches = [torch.tensor([lm.tokenizer(t)["input_ids"][:96]]) for t in sample_texts(6)]
    stats = collect_stats(lm.model, lm.layers, batches, ("down",))
    targets = {Level.CONSERVATIVE: 0.3, Level.BALANCED: 0.5, Level.AGGRESSIVE: 0.7}
    plans = {
        level: SparsityPlan(
            level,
            thresholds_for(stats, uniform_targets(stats, ("down",), target)),
            calibration_version=f"tiny-{level.value}",
        )
        for level, target in targets.items()
    }
    return Engine(lm, plans, PrefixCache() if cache else None)


def calibration_of(engine: Engine, version: str, weights: str | None = None) -> Calibration:
    """The tiny engine's balanced plan as a calibration artefact under another version."""
    plan = engine.plan(Level.BALANCED)
    return Calibration(
        model_id=engine.lm.model_id,
        weights_sha256=weights or engine.lm.weights_sha256,
        level="balanced",
        sparsifier="threshold",
        thresholds={role: list(values) for role, values in plan.thresholds.items()},
        topk=None,
        silence_thresholds=list(plan.thresholds["down"]),
        target_sparsity=0.5,
        realised_sparsity=0.5,
        perplexity_dense=10.0,
        perplexity_sparse=10.1,
        budget_pct=2.0,
        data={"corpus": "test"},
        duration_s=0.0,
        version=version,
    )
