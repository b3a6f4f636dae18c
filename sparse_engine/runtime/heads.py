"""Logits at some positions only: a teacher-forced pass (the probe, the KL drift pass) needs
each row's answer span, and a (B, T, vocab) tensor of logits would take B x T x vocab x 4
bytes (1 GB for 16 SmolLM2 probes of 300 tokens, 8 GB for 16 Gemma 3 prompts of 500). The
time saved is smaller: `sparseguard bench engine` prints both ways."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def span_logits(
    model: Any, ids: torch.Tensor, mask: torch.Tensor | None, spans: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Each row's logits over its span of positions: the head runs on those positions only
    (the final norm's output, caught by a hook), with the model's own logit soft-capping."""
    norm = _final_norm(model)
    if norm is None or not keeps_logits(model):
        logits = model(input_ids=ids, attention_mask=mask).logits
        return [logits[b, start:end] for b, (start, end) in enumerate(spans)]
    caught: list[torch.Tensor] = []
    handle = norm.register_forward_hook(lambda module, args, out: caught.append(out))
    try:
        model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
    finally:
        handle.remove()
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    out = []
    for b, (start, end) in enumerate(spans):
        logits = head(caught[-1][b, start:end])
        out.append(torch.tanh(logits / cap) * cap if cap else logits)
    return out


def keeps_logits(model: Any) -> bool:
    """Whether `model.forward` takes `logits_to_keep` (recent Hugging Face causal LMs do)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _final_norm(model: Any) -> torch.nn.Module | None:
    """The norm before the head (Llama, Qwen2, Gemma: model.norm; GPT-2: transformer.ln_f)."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    found = getattr(inner, "norm", None) or getattr(inner, "ln_f", None)
    return found if isinstance(found, torch.nn.Module) else None
