"""The plain chat template, for a model without one of its own (a base model such as
Gemma 3 270M, or a GGUF that ships none): the system text, then `User:` and `Assistant:`
turns, ending with `Assistant:` when a reply is wanted. Stated in the README's model table."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PLAIN_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
PLAIN_STOPS = ("\nUser:",)  # a base model goes on to write the next turn itself


def template_stops(tokenizer: Any) -> tuple[str, ...]:
    """Stop sequences a chat under the tokenizer's template needs beyond end-of-sequence."""
    return PLAIN_STOPS if getattr(tokenizer, "chat_template", None) == PLAIN_TEMPLATE else ()


def bos_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The tokens the tokenizer puts before any text (Gemma's <bos>; none for SmolLM2 and
    Qwen2). Text scored or sampled without them is not what the model was trained on: Gemma
    3 270M's perplexity on Wikipedia chunks was 34.5 without <bos> and 14.0 with it."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    cut = len(full) - len(plain)
    return tuple(full[:cut]) if cut > 0 and full[cut:] == plain else ()


def ensure_template(tokenizer: Any, model_id: str) -> None:
    """Give a tokenizer without a chat template the plain one, and say so."""
    if not getattr(tokenizer, "chat_template", None):
        log.warning("%s has no chat template: chats use the plain template", model_id)
        tokenizer.chat_template = PLAIN_TEMPLATE
