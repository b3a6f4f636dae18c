"""Benchmarks: decode speed against the memory-bandwidth ceiling (`speed`), its GPU variant for
a lent machine (`speed_gpu`, run as `python -m sparse_engine.bench.speed_gpu`) and the
llama.cpp comparison run in its own process (`llama_cpp_run`). May import everything."""

from sparse_engine.bench.speed import SpeedRow, fast_speed, reference_speed

__all__ = [
    "SpeedRow",
    "fast_speed",
    "reference_speed",
]
