"""Token log-probabilities in each OpenAI endpoint's shape. They are the served model's own
(log-softmax of its logits at the request's level, before penalties, logit bias and
temperature): what the trust score reads, and what a caller scoring text by likelihood wants."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparse_engine.runtime.generation import GenerationStats
from sparse_engine.runtime.sampling import TopLogprobs

TokenText = Callable[[int], str]  # a token id's text, decoded alone


def chat_logprobs(stats: GenerationStats, token_text: TokenText) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: one entry per generated token."""
    content = []
    for k, (token, logprob) in enumerate(zip(stats.token_ids, stats.token_logprobs, strict=False)):
        top = stats.top_logprobs[k] if k < len(stats.top_logprobs) else []
        entry = _entry(token, logprob, token_text)
        entry["top_logprobs"] = [_entry(t, lp, token_text) for t, lp in top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    stats: GenerationStats, token_text: TokenText, echo: bool, prompt_chars: int
) -> dict[str, Any]:
    """`choices[i].logprobs` of a legacy completion: parallel lists over the prompt's tokens
    (with echo; the first has no log-probability) and then the generated ones."""
    ids: list[int] = []
    logprobs: list[float | None] = []
    tops: list[TopLogprobs | None] = []
    if echo:
        ids += stats.prompt_ids
        logprobs += stats.prompt_logprobs
        tops += [
            top if k else None for k, top in enumerate(_padded(stats.prompt_top_logprobs, ids))
        ]
    # Every sampled token, the end-of-sequence one that stopped it included (its text is not
    # in the answer): a caller that asked for one token and drops it gets the prompt's.
    generated = stats.token_ids + ([stats.stop_token] if stats.stop_token is not None else [])
    ids += generated
    logprobs += stats.token_logprobs[: len(generated)]
    tops += _padded(stats.top_logprobs, generated)
    tokens = [token_text(t) for t in ids]
    offsets, at = [], 0 if echo else prompt_chars
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [
            None if top is None else {token_text(t): lp for t, lp in top} for top in tops
        ],
        "text_offset": offsets,
    }


def _padded(tops: list[TopLogprobs], ids: list[int]) -> list[TopLogprobs | None]:
    return [tops[k] if k < len(tops) else [] for k in range(len(ids))]


def _entry(token: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
