"""Data: pinned files from the package registry (`packages`), the named corpora read out of
them (`corpora`), and the one split policy every user of a corpus follows (`splits`:
calibration from the front, held-out text from the back, evaluation from the middle).
Imports nothing else of the library."""

from sparse_engine.data.corpora import (
    Corpus,
    CorpusError,
    corpus_names,
    halueval_items,
    load_texts,
    mtbench_questions,
    mtbench_references,
)
from sparse_engine.data.packages import FetchError, PinnedPackage, fetch_package
from sparse_engine.data.splits import (
    CorpusTooSmallError,
    calibration_split,
    evaluation_tokens,
    front_documents,
    shuffled,
)

__all__ = [
    "Corpus",
    "CorpusError",
    "CorpusTooSmallError",
    "FetchError",
    "PinnedPackage",
    "calibration_split",
    "corpus_names",
    "evaluation_tokens",
    "fetch_package",
    "front_documents",
    "halueval_items",
    "load_texts",
    "mtbench_questions",
    "mtbench_references",
    "shuffled",
]
