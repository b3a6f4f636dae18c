"""Decode speed at batch 1 on a CUDA device, for a lent GPU machine where the project's
services are not installed and the real weights cannot travel (its working tree is capped
below the model's size): `python -m sparse_engine.bench.speed_gpu CONFIG_DIR [--device cuda]
[--compiled] [--no-fast]`.

The model is built from the real model's config with random weights. Speed does not depend on
the weights' values; quality is not measured here. It reports tokens/s of the reference
(Hugging Face forward per token with its KV cache) and of the fast path's PyTorch route (the
compiled kernels are for the CPU), dense and with thresholds at `--sparsity` of every
projection's input on this model, float32 and bfloat16 (`--no-fast` leaves these out);
`--compiled` adds transformers' static-cache `generate`, compiled with CUDA graphs on a GPU. Every
row gives the weight bytes a token reads, and the report the measured matrix-vector bandwidth.
The fast float32 dense and the compiled rows' greedy tokens are compared to the reference's.
Prints one JSON object."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from sparse_engine.bench.speed import reference_bytes
from sparse_engine.calibration.allocation import thresholds_for, uniform_targets
from sparse_engine.calibration.stats import collect_stats
from sparse_engine.model.arch import find_layers
from sparse_engine.runtime.fastpath import ROLES, FastDecoder
from sparse_engine.sparsity.plan import Level, SparsityPlan


def bandwidth(device: torch.device, megabytes: int = 2048) -> float:
    """Bytes/s of a float32 matrix-vector product over `megabytes` of weights."""
    cols = 4096
    weights = torch.randn(megabytes * 2**20 // (4 * cols), cols, device=device)
    x = torch.randn(cols, device=device)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        started = time.perf_counter()
        weights @ x
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return weights.numel() * 4 / best


def reference(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """Greedy decode with the Hugging Face forward and DynamicCache: (tokens/s, tokens)."""
    # transformers renamed past_key_values to cache; GPU images may hold an older release
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        kwargs = {name: DynamicCache(config=model.config), "use_cache": True}
        logits = model(input_ids=prompt[None], **kwargs).logits
        tokens = [int(logits[0, -1].argmax())]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            step = torch.tensor([[tokens[-1]]], device=prompt.device)
            logits = model(input_ids=step, **kwargs).logits
            tokens.append(int(logits[0, -1].argmax()))
        return (new_tokens - 1) / (time.perf_counter() - started), tokens


def compiled(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """Greedy decode through `generate` with a static cache, which transformers compiles
    (torch.compile, CUDA graphs) on a GPU: (tokens/s of the steps after the first, tokens).
    Both lengths are run twice first so that compiling and capturing are not timed."""

    def timed(n: int) -> tuple[float, list[int]]:
        _sync(prompt.device)
        started = time.perf_counter()
        out = model.generate(
            prompt[None],
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        _sync(prompt.device)
        return time.perf_counter() - started, out[0, len(prompt) :].tolist()

    for n in (1, new_tokens, 1, new_tokens):
        timed(n)
    first, _ = timed(1)
    total, tokens = timed(new_tokens)
    return (new_tokens - 1) / (total - first), tokens


def fast(
    decoder: FastDecoder, prompt: torch.Tensor, plan: SparsityPlan, new_tokens: int
) -> tuple[float, list[int]]:
    decoder.reset()
    tokens = [int(decoder.prefill(prompt.tolist(), plan).argmax())]
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        tokens.append(int(decoder.step(tokens[-1], plan).argmax()))
    return (new_tokens - 1) / (time.perf_counter() - started), tokens


def run(
    config_dir: str, device_name: str, new_tokens: int, sparsity: float, paths: set[str]
) -> dict[str, Any]:
    device = torch.device(device_name)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompt = torch.randint(0, config.vocab_size, (32,))
    stats = collect_stats(model, find_layers(model), [prompt[None]], ROLES)  # on the CPU
    sparse = SparsityPlan(
        Level.BALANCED, thresholds_for(stats, uniform_targets(stats, ROLES, sparsity))
    )
    model, prompt = model.to(device), prompt.to(device)
    lm: Any = SimpleNamespace(model=model)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "bandwidth_gb_per_s": bandwidth(device) / 1e9,
        "new_tokens": new_tokens,
        "rows": [],
    }
    dense_bytes = reference_bytes(model)  # the reference's and the compiled rows' reads
    reference(model, prompt, 8)  # warm-up
    ref_tps, ref_tokens = reference(model, prompt, new_tokens)
    row = {
        "path": "reference",
        "weights": "float32",
        "level": "dense",
        "tokens_per_s": ref_tps,
        "bytes_per_token": dense_bytes,
    }
    report["rows"].append(row)
    if "compiled" in paths:
        tps, tokens = compiled(model, prompt, new_tokens)
        row = {
            "path": "reference, static cache compiled (CUDA graphs)",
            "weights": "float32",
            "level": "dense",
            "tokens_per_s": tps,
            "bytes_per_token": dense_bytes,
            "greedy_tokens_equal_reference": tokens == ref_tokens,
        }
        report["rows"].append(row)
    if "fast" not in paths:
        return report
    for dtype in ("float32", "bfloat16"):
        decoder = FastDecoder(lm, max_len=len(prompt) + new_tokens + 1, dtype=dtype)
        for level, plan in (("dense", SparsityPlan()), (f"{sparsity:.0%} every input", sparse)):
            fast(decoder, prompt, plan, 8)  # warm-up
            decoder.weights_read = decoder.weights_total = 0.0
            tps, tokens = fast(decoder, prompt, plan, new_tokens)
            row = {
                "path": "fast (pytorch)",
                "weights": dtype,
                "level": level,
                "tokens_per_s": tps,
                "bytes_per_token": decoder.weight_bytes(decoder.read_share),
            }
            if dtype == "float32" and level == "dense":
                row["greedy_tokens_equal_reference"] = tokens == ref_tokens
            report["rows"].append(row)
        del decoder
    return report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", help="a directory holding the model's config.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument(
        "--compiled", action="store_true", help="add the compiled static-cache reference"
    )
    parser.add_argument("--no-fast", action="store_true", help="skip the fast path's rows")
    args = parser.parse_args()
    paths = {"compiled"} if args.compiled else set()
    if not args.no_fast:
        paths.add("fast")
    report = run(args.config_dir, args.device, args.new_tokens, args.sparsity, paths)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
