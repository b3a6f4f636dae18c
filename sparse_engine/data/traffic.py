"""Prompts that stand for traffic: healthy kinds (chat, passage QA, code, prose, summaries) drawn
from the packaged corpora, with two disjoint halves (`baseline` for the calibration's baseline
pass, `evaluation` for judging the alarms on requests the baseline never saw), and the faulty
inputs the alarms must catch (garbage, templated, another language, prefix-defeating).

None of these corpora is the calibration corpus's sample; a kind's prompts come from its own
corpus in the fixed shuffled order, baseline from the front half and evaluation from the back."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sparse_engine.data.corpora import halueval_items, load_texts
from sparse_engine.data.splits import shuffled

Split = Literal["baseline", "evaluation"]
HEALTHY_KINDS = ("chat", "qa", "code", "prose", "summary")
DEFAULT_BASELINE_KINDS = ("chat", "qa", "code", "prose")
MAX_PROMPT_CHARS = 700
MIN_PROMPT_CHARS = 20
# A system prompt many requests share, as chat products send: the prefix cache's workload.
SHARED_SYSTEM = (
    "You are a helpful, concise assistant for a software company. Answer the user's question "
    "accurately and briefly. If you do not know the answer, say so."
)


@dataclass(frozen=True, slots=True)
class Prompt:
    kind: str
    text: str
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        turns = [{"role": "system", "content": self.system}] if self.system else []
        return [*turns, {"role": "user", "content": self.text}]


def healthy(kind: str, home: Path, split: Split, count: int) -> list[Prompt]:
    """`count` prompts of one healthy kind from its half of the corpus."""
    if kind not in HEALTHY_KINDS:
        raise ValueError(f"unknown traffic kind {kind!r}; choose from {', '.join(HEALTHY_KINDS)}")
    texts = _half(_SOURCES[kind](home), split)
    if len(texts) < count:
        raise ValueError(f"only {len(texts)} {kind} prompts in the {split} half; ask for fewer")
    return [Prompt(kind, text) for text in texts[:count]]


def mix(kinds: tuple[str, ...], home: Path, split: Split, count: int) -> list[Prompt]:
    """`count` prompts spread evenly over `kinds`, interleaved."""
    per_kind = -(-count // len(kinds))
    pools = [healthy(kind, home, split, per_kind) for kind in kinds]
    mixed = [pool[i] for i in range(per_kind) for pool in pools]
    return mixed[:count]


def garbage(count: int, seed: int = 0) -> list[Prompt]:
    """Random bytes read as Latin-1, and runs of characters from mixed scripts."""
    rng = random.Random(seed)
    scripts = [(0x0400, 0x04FF), (0x0600, 0x06FF), (0x4E00, 0x4FFF), (0x0900, 0x097F)]
    found = []
    for i in range(count):
        length = rng.randint(60, 300)
        if i % 2 == 0:
            text = bytes(rng.randrange(32, 256) for _ in range(length)).decode("latin-1")
        else:
            ranges = [rng.choice(scripts) for _ in range(length)]
            text = "".join(chr(rng.randint(lo, hi)) for lo, hi in ranges)
        found.append(Prompt("garbage", text))
    return found


def templated(home: Path, count: int, index: int = 0) -> list[Prompt]:
    """One chat prompt (the `index`th of the evaluation half), repeated: a client replaying a
    template."""
    prompt = healthy("chat", home, "evaluation", index + 1)[index]
    return [Prompt("templated", prompt.text)] * count


def language_shift(home: Path, count: int, offset: int = 0) -> list[Prompt]:
    """Paragraphs of the multilingual corpus, as they are, from the `offset`th on."""
    texts = [t[:MAX_PROMPT_CHARS] for t in shuffled(load_texts("multilingual", home))]
    found = [Prompt("multilingual", text) for text in texts if len(text) >= MIN_PROMPT_CHARS]
    return found[offset : offset + count]


def with_system(prompts: list[Prompt], system: str = SHARED_SYSTEM) -> list[Prompt]:
    return [Prompt(p.kind, p.text, system) for p in prompts]


def prefix_defeating(prompts: list[Prompt], seed: int = 0) -> list[Prompt]:
    """The shared system prompt with a random request id in front of it: no prefix to reuse."""
    rng = random.Random(seed)
    return [
        Prompt("prefix-defeating", p.text, f"[request {rng.getrandbits(64):016x}] {SHARED_SYSTEM}")
        for p in prompts
    ]


def _half(texts: list[str], split: Split) -> list[str]:
    kept = [t for t in texts if MIN_PROMPT_CHARS <= len(t) <= MAX_PROMPT_CHARS]
    middle = len(kept) // 2
    return kept[:middle] if split == "baseline" else kept[middle:]


def _chat(home: Path) -> list[str]:
    return shuffled(load_texts("sharegpt", home), seed=1)


def _qa(home: Path) -> list[str]:
    items = shuffled(
        [f"{i.knowledge}\n\nQuestion: {i.question}" for i in halueval_items(home)], seed=1
    )
    return [f"Answer the question from the passage.\n\n{text}" for text in items]


def _code(home: Path) -> list[str]:
    snippets = shuffled(load_texts("code", home), seed=1)
    return [f"What does this code do?\n\n{s[:500]}" for s in snippets]


def _prose(home: Path) -> list[str]:
    lines = shuffled(load_texts("c4", home), seed=1)
    return [f"Continue this text:\n\n{line[:500]}" for line in lines]


def _summary(home: Path) -> list[str]:
    paragraphs = shuffled(load_texts("technical", home), seed=1)
    return [f"Summarise in one sentence:\n\n{p[:550]}" for p in paragraphs]


_SOURCES: dict[str, Callable[[Path], list[str]]] = {
    "chat": _chat,
    "qa": _qa,
    "code": _code,
    "prose": _prose,
    "summary": _summary,
}
