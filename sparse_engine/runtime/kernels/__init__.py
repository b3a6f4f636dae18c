"""The compiled sparse decode kernels (`rows_matvec.cpp`), built with PyTorch's C++ extension
tooling by `sparseguard kernels build` (the install runs it) or on first use, with a
pure-PyTorch fallback where no compiler is available. The build is for this machine's
processor, so it goes to one directory per machine, whatever the service's home:
$SPARSEGUARD_KERNELS_DIR, else ~/.cache/sparseguard/kernels. The module holds `rows_matvec`,
below, and `Layers`, every decoder layer of one token in one call.

`rows_matvec(x, w, scale, threshold, begin, end)` -> (y, rows read, sum |x| over them, sum |x|):
y = sum of x_i * w[i, begin:end] over the rows whose |x_i| > threshold (every row when
threshold < 0); w is input-major (in, out), float32, bfloat16 (x and y are rounded to
bfloat16, as a bfloat16 matrix product rounds them), or int8 with one float32 scale per row."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("rows_matvec.cpp")
_lock = threading.Lock()
_loaded: dict[str, Any] = {}


class KernelUnavailableError(RuntimeError):
    pass


Result = tuple[torch.Tensor, int, float, float]


def build_dir() -> Path:
    configured = os.environ.get("SPARSEGUARD_KERNELS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "sparseguard" / "kernels"


def build(verbose: bool = False) -> Any:
    """Compile (or load the cached build of) the extension; raise KernelUnavailableError with
    the reason when it cannot be built."""
    with _lock:
        if "module" in _loaded:
            return _loaded["module"]
        from torch.utils import cpp_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
        # PyTorch's own build lock is a file that only its holder removes: a process killed
        # while holding it (a worker stopped at start-up) left every later build waiting
        # forever. An OS lock is released when its holder dies, so whoever holds it knows a
        # leftover file is stale.
        with (directory / "build.flock").open("w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (directory / "lock").unlink(missing_ok=True)
            try:
                module = cpp_extension.load(
                    name="sparseguard_rows",
                    sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=verbose,
                )
            except (RuntimeError, OSError, ImportError) as exc:
                msg = f"could not build the sparse kernel: {exc}"
                raise KernelUnavailableError(msg) from exc
        _loaded["module"] = module
        return module


def torch_rows_matvec(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    threshold: float,
    begin: int = 0,
    end: int = -1,
) -> Result:
    """The pure-PyTorch fallback: gathers the kept rows (a copy) and multiplies."""
    coef = x * scale if scale is not None else x
    columns = w[:, begin : end if end >= 0 else w.shape[1]]
    magnitude = x.abs()
    total = float(magnitude.sum())
    if threshold < 0:
        return weight_product(coef, columns), x.shape[0], total, total
    index = (magnitude > threshold).nonzero().squeeze(1)
    y = weight_product(coef[index], columns.index_select(0, index))
    return y, index.numel(), float(magnitude[index].sum()), total


def weight_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w in float32; bfloat16 weights multiply as a bfloat16 product (input and result
    rounded to bfloat16, float32 sums), natively on a GPU."""
    if w.dtype != torch.bfloat16:
        return x @ w.to(torch.float32)
    if w.is_cuda:
        return (x.to(w.dtype) @ w).float()
    return (x.to(w.dtype).float() @ w.float()).to(w.dtype).float()


def load() -> Any | None:
    """The compiled module when it builds, else None, with the reason logged: callers then
    use the PyTorch fallback."""
    try:
        return build()
    except KernelUnavailableError as exc:
        log.warning("%s; using the pure-PyTorch fallback", exc)
        return None
