"""Compression: silent channels (`silence`) and the ablation-confirmed silence map
(`silence_map`), structural pruning (`prune`, plan B) and 2:4 semi-structured sparsity
(`semi24`, plan C). May import `trust`, `calibration`, `runtime` and everything below."""

from sparse_engine.compression.prune import PruneResult, Verification, prune, pruned_copy, verify
from sparse_engine.compression.semi24 import compliance_table, semi24_copy
from sparse_engine.compression.silence import (
    ChannelSet,
    ChannelSite,
    SilenceMap,
    SilenceRule,
    capture,
)
from sparse_engine.compression.silence_map import build_map

__all__ = [
    "ChannelSet",
    "ChannelSite",
    "PruneResult",
    "SilenceMap",
    "SilenceRule",
    "Verification",
    "build_map",
    "capture",
    "compliance_table",
    "prune",
    "pruned_copy",
    "semi24_copy",
    "verify",
]
