"""Trust: is an answer likely wrong? The features read from the engine's signals (`features`), the
logistic trust model and its store (`model`) over its regression (`regression`), QA items and
grading (`qa`), answering and recording them (`evaluate`) and the AUROC report (`report`). May
import `calibration`, `runtime` and everything below."""

from sparse_engine.trust.features import RequestSignals, SilenceBaseline, from_stats
from sparse_engine.trust.model import TrustModel, TrustModelNotFoundError, TrustStore, fit
from sparse_engine.trust.qa import QAItem, grade, load_qa, qa_messages
from sparse_engine.trust.report import TrustReport, report

__all__ = [
    "QAItem",
    "RequestSignals",
    "SilenceBaseline",
    "TrustModel",
    "TrustModelNotFoundError",
    "TrustReport",
    "TrustStore",
    "fit",
    "from_stats",
    "grade",
    "load_qa",
    "qa_messages",
    "report",
]
