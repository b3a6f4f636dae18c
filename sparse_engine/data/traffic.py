"""Prompts that stand for traffic: healthy kinds (chat, passage QA, code, prose, summaries, data
tables) drawn from the packaged corpora, with two disjoint halves (`baseline` for the
calibration's baseline pass, `evaluation` for judging the alarms on requests the baseline never
saw), and the faulty inputs the alarms must catch (garbage, templated, another language,
prefix-defeating).

None of these corpora is the calibration corpus's sample; a kind's prompts come from its own
corpus in the fixed shuffled order, baseline from the front half of its documents and
evaluation from the back (code, prose and table documents give a prompt per 500-character
window)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sparse_engine.data.corpora import halueval_items, load_texts
from sparse_engine.data.splits import shuffled

Split = Literal["baseline", "evaluation"]
HEALTHY_KINDS = ("chat", "qa", "code", "prose", "summary", "data")
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


def healthy(
    kind: str, home: Path, split: Split, count: int, *, at_most: bool = False
) -> list[Prompt]:
    """`count` prompts of one healthy kind from its half of the corpus (`at_most`: as many as
    the half holds, when that is fewer)."""
    if kind not in HEALTHY_KINDS:
        raise ValueError(f"unknown traffic kind {kind!r}; choose from {', '.join(HEALTHY_KINDS)}")
    texts = _half(_SOURCES[kind](home), split)
    if len(texts) < count and not at_most:
        raise ValueError(f"only {len(texts)} {kind} prompts in the {split} half; ask for fewer")
    return [Prompt(kind, text) for text in texts[:count]]


def mix(
    kinds: tuple[str, ...], home: Path, split: Split, count: int, *, at_most: bool = False
) -> list[Prompt]:
    """`count` prompts spread evenly over `kinds`, interleaved (`at_most`: a kind whose half
    holds fewer gives all it has, and the mix is that much shorter)."""
    per_kind = -(-count // len(kinds))
    pools = [healthy(kind, home, split, per_kind, at_most=at_most) for kind in kinds]
    mixed = [pool[i] for i in range(per_kind) for pool in pools if i < len(pool)]
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


def half_with_system(prompts: list[Prompt], system: str = SHARED_SYSTEM) -> list[Prompt]:
    """Every other prompt of each kind behind the shared system prompt (chat products send
    one; the prefix cache sees both): each kind measured both ways, whatever the mix. Every
    other prompt of an interleaved mix of four kinds gave chat and code the system prompt
    and QA and prose none, so a held-out QA request with it was not like the baseline's."""
    seen: dict[str, int] = {}
    found = []
    for p in prompts:
        index = seen[p.kind] = seen.get(p.kind, -1) + 1
        found.append(Prompt(p.kind, p.text, system) if index % 2 == 0 else p)
    return found


def prefix_defeating(prompts: list[Prompt], seed: int = 0) -> list[Prompt]:
    """The shared system prompt with a random request id in front of it: no prefix to reuse."""
    rng = random.Random(seed)
    return [
        Prompt("prefix-defeating", p.text, f"[request {rng.getrandbits(64):016x}] {SHARED_SYSTEM}")
        for p in prompts
    ]


def _half(docs: list[list[str]], split: Split) -> list[str]:
    """The front or back half of the documents (a document's prompts stay in one half), their
    prompts taken round-robin: every document's first, then every second, and so on. The code
    corpus holds overlapping copies of some files: a prompt of the front half is not in the
    back one."""
    unique = dict.fromkeys(tuple(doc) for doc in docs)
    kept = [ok for doc in unique if (ok := [t for t in doc if _fits(t)])]
    middle = len(kept) // 2
    front = _round_robin(kept[:middle])
    if split == "baseline":
        return front
    seen = set(front)
    return [t for t in _round_robin(kept[middle:]) if t not in seen]


def _round_robin(docs: list[list[str]]) -> list[str]:
    rounds = max((len(doc) for doc in docs), default=0)
    return [doc[i] for i in range(rounds) for doc in docs if i < len(doc)]


def _fits(text: str) -> bool:
    return MIN_PROMPT_CHARS <= len(text) <= MAX_PROMPT_CHARS


def _windows(text: str, size: int) -> list[str]:
    """`text` in windows of `size` characters (a last one under half a window is dropped): the
    small code and prose corpora then give each kind the 99+ baseline prompts a 1 % per-kind
    test needs."""
    return [
        text[i : i + size]
        for i in range(0, len(text), size)
        if i == 0 or len(text) - i >= size // 2
    ]


def _chat(home: Path) -> list[list[str]]:
    return [[t] for t in shuffled(load_texts("sharegpt", home), seed=1)]


def _qa(home: Path) -> list[list[str]]:
    items = shuffled(
        [f"{i.knowledge}\n\nQuestion: {i.question}" for i in halueval_items(home)], seed=1
    )
    return [[f"Answer the question from the passage.\n\n{text}"] for text in items]


def _code(home: Path) -> list[list[str]]:
    snippets = shuffled(load_texts("code", home), seed=1)
    return [[f"What does this code do?\n\n{w}" for w in _windows(s, 500)] for s in snippets]


def _prose(home: Path) -> list[list[str]]:
    lines = shuffled(load_texts("c4", home), seed=1)
    return [[f"Continue this text:\n\n{w}" for w in _windows(line, 500)] for line in lines]


def _summary(home: Path) -> list[list[str]]:
    paragraphs = shuffled(load_texts("technical", home), seed=1)
    return [[f"Summarise in one sentence:\n\n{p[:550]}"] for p in paragraphs]


def _data(home: Path) -> list[list[str]]:
    tables = shuffled(load_texts("tables", home), seed=1)
    return [[f"What does this data show?\n\n{w}" for w in _windows(t, 500)] for t in tables]


_SOURCES: dict[str, Callable[[Path], list[list[str]]]] = {
    "chat": _chat,
    "qa": _qa,
    "code": _code,
    "prose": _prose,
    "summary": _summary,
    "data": _data,
}
