"""Evaluation: held-out perplexity under any plan (`perplexity`) and ranking quality (`ranking`,
AUROC). May import `sparsity`, `model` and `data`."""

from sparse_engine.evaluation.perplexity import PerplexityResult, perplexity
from sparse_engine.evaluation.ranking import auroc

__all__ = [
    "PerplexityResult",
    "auroc",
    "perplexity",
]
