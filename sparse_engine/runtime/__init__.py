"""Runtime: the engine that streams tokens under a level's plan and measures them (`engine`), what
a caller asks and gets (`generation`), sampling, incremental detokenisation, the prefix KV cache,
the teacher-forced probe of a given answer (`scoring`), logits at some positions only (`heads`),
and the lean decode path with its compiled kernels (`fastpath`, `kernels`), continuous batching
(`scheduler`, `batch`, `packed`). May import `sparsity`, `evaluation`, `model`, `data`; never
`calibration` (the engine takes plans, not stores)."""

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.fastpath import FastDecoder
from sparse_engine.runtime.generation import Generation, GenerationRequest, GenerationStats, Message
from sparse_engine.runtime.prefix_cache import CacheKey, PrefixCache, SparseCacheMismatchError
from sparse_engine.runtime.scoring import score_answer

__all__ = [
    "CacheKey",
    "Engine",
    "FastDecoder",
    "Generation",
    "GenerationRequest",
    "GenerationStats",
    "Message",
    "PrefixCache",
    "SparseCacheMismatchError",
    "score_answer",
]
