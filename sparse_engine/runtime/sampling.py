"""Next-token choice: greedy at temperature 0, otherwise temperature + nucleus (top-p); the
confidence of each chosen token; the tokens that end a sequence."""

from __future__ import annotations

import torch

from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity import signals


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # always keeps the top token
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


class TokenConfidence:
    """Log-probability of each chosen token and the entropy it was drawn from; kept as
    tensors and read once at the end, so a step costs one log-softmax and no sync."""

    def __init__(self) -> None:
        self._logprobs: list[torch.Tensor] = []
        self._entropies: list[torch.Tensor] = []

    def observe(self, logits: torch.Tensor, token: int) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        self._logprobs.append(logp[token])
        self._entropies.append(signals.entropy_nats(logp))

    @property
    def logprobs(self) -> list[float]:
        return torch.stack(self._logprobs).tolist() if self._logprobs else []

    @property
    def entropies(self) -> list[float]:
        return torch.stack(self._entropies).tolist() if self._entropies else []


def eos_ids(lm: LoadedModel) -> set[int]:
    found: set[int] = set()
    config = getattr(lm.model, "generation_config", None)
    for value in (lm.tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return found
