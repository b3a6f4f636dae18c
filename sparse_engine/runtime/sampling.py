"""Next-token choice: OpenAI's presence/frequency penalties and logit bias on the logits, then
greedy at temperature 0, otherwise temperature + top-k + nucleus (top-p); the confidence of
each chosen token (with the most likely alternatives when asked); the tokens that end a
sequence."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity import signals

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    # Shifted so the largest is 0, in float64: no temperature above 0 overflows to NaN (a
    # denormal one divides every other logit to -inf: greedy).
    probs = torch.softmax((logits.double() - logits.max()) / temperature, dim=-1).float()
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # always keeps the top token
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


class LogitAdjust:
    """OpenAI's definition: logit[j] - count[j] * frequency - (count[j] > 0) * presence +
    bias[j], where count[j] is how often token j was generated so far in this answer."""

    def __init__(
        self, vocab: int, presence: float, frequency: float, bias: Mapping[int, float]
    ) -> None:
        outside = [token for token in bias if not 0 <= token < vocab]
        if outside:
            raise ValueError(
                f"logit_bias: token id {outside[0]} is outside the vocabulary (0-{vocab - 1})"
            )
        self.active = bool(presence or frequency or bias)
        self.presence, self.frequency = presence, frequency
        self.bias = torch.zeros(vocab)
        for token, value in bias.items():
            self.bias[token] = value
        self.counts = torch.zeros(vocab)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        seen = (self.counts > 0).float()
        return logits.float() - self.counts * self.frequency - seen * self.presence + self.bias

    def chose(self, token: int) -> None:
        self.counts[token] += 1


class TokenConfidence:
    """Log-probability of each chosen token and the entropy it was drawn from, under the
    model's own distribution (before penalties, bias and temperature); kept as tensors and read
    once at the end, so a step costs one log-softmax and no sync. `top`: also the `top` most
    likely tokens of each step."""

    def __init__(self, top: int = 0) -> None:
        self.top = top
        self._logprobs: list[torch.Tensor] = []
        self._entropies: list[torch.Tensor] = []
        self._top: list[tuple[torch.Tensor, torch.Tensor]] = []

    def observe(self, logits: torch.Tensor, token: int) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        self._logprobs.append(logp[token])
        self._entropies.append(signals.entropy_nats(logp))
        if self.top:
            found = logp.topk(self.top)
            self._top.append((found.indices, found.values))

    @property
    def logprobs(self) -> list[float]:
        return torch.stack(self._logprobs).tolist() if self._logprobs else []

    @property
    def entropies(self) -> list[float]:
        return torch.stack(self._entropies).tolist() if self._entropies else []

    @property
    def top_logprobs(self) -> list[TopLogprobs]:
        return [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in self._top]


def eos_ids(lm: LoadedModel) -> set[int]:
    found: set[int] = set()
    config = getattr(lm.model, "generation_config", None)
    for value in (lm.tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
    return found
