"""Continuous batching (`sparse_engine.runtime.scheduler`) on tiny Llama, Qwen2 and Gemma 3
models: the same prompts at temperature 0, batched with others at other levels vs alone,
give the same tokens and the same per-request signals and readout within float tolerance, on
the fast path (compiled kernels and PyTorch fallback; their prompts prefilled in one packed
pass) and the reference path; admission, cancellation, the token budget and the batched drift
pass."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sparse_engine.runtime import kernels
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.runtime.offline import generate_all
from sparse_engine.runtime.sampling import sample_next
from sparse_engine.runtime.scheduler import Scheduler
from sparse_engine.runtime.scoring import Probe, score_many
from sparse_engine.runtime.tickets import QueueFullError
from sparse_engine.sparsity.plan import Level, SparsityPlan
from tests.tiny import tiny_engine

PROMPTS = [
    "Once upon a time there was a little robot who",
    "The weather today",
    "Write a short note about the sea and the wind, and",
    "Q: what is two plus two? A:",
    "Hello",
]
LEVELS = [Level.DENSE, Level.CONSERVATIVE, Level.BALANCED, Level.AGGRESSIVE, Level.BALANCED]


class Collect:
    """A sink that keeps what it is given."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.stats: GenerationStats | None = None
        self.failure: Exception | None = None
        self.over = threading.Event()
        self.began = self.ended = 0.0

    def started(self) -> None:
        self.began = time.perf_counter()

    def delta(self, text: str) -> None:
        self.deltas.append(text)

    def done(self, stats: GenerationStats) -> None:
        self.stats = stats
        self.ended = time.perf_counter()
        self.over.set()

    def error(self, exc: Exception) -> None:
        self.failure = exc
        self.over.set()

    def result(self) -> GenerationStats:
        assert self.over.wait(60), "the scheduler never finished the request"
        assert self.failure is None, self.failure
        assert self.stats is not None
        return self.stats


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _engine(family: str, path: str, dtype: str = "float32") -> Engine:
    engine = tiny_engine(cache=False, family=family)
    if path != "reference":
        native = kernels.load() if path == "native" else None
        engine.enable_fast_path(dtype, native, max_len=256)
        assert engine.fast is not None
    return engine


def _request(i: int, **extra: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "prompt": PROMPTS[i],
        "max_new_tokens": 6 + 3 * i,  # they leave the batch at different steps
        "ignore_eos": True,
        "readout": True,
        "use_prefix_cache": False,
    }
    return GenerationRequest(**{**fields, **extra})


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    made = Scheduler(max_batch=8, batch_from=2)
    yield made
    made.close()


def _together(
    scheduler: Scheduler, engine: Engine, jobs: list[tuple[GenerationRequest, Any]]
) -> list[Collect]:
    """Submit every job while the scheduler is held, so they are admitted at one boundary,
    and wait for them."""
    sinks = _submit_together(scheduler, engine, jobs)
    for sink in sinks:
        sink.result()
    return sinks


def _submit_together(
    scheduler: Scheduler, engine: Engine, jobs: list[tuple[GenerationRequest, Any]]
) -> list[Collect]:
    scheduler.call(lambda: scheduler.attach(engine)).result()
    gate = threading.Event()
    scheduler.call(gate.wait)
    sinks = [Collect() for _ in jobs]
    for (request, level), sink in zip(jobs, sinks, strict=True):
        scheduler.submit(request, level, sink)
    gate.set()
    return sinks


def _same(alone: GenerationStats, batched: GenerationStats) -> None:
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text
    assert batched.finish_reason == alone.finish_reason
    torch.testing.assert_close(batched.token_logprobs, alone.token_logprobs, rtol=1e-4, atol=1e-5)
    a, b = alone.signals, batched.signals
    assert a is not None and b is not None
    for name in ("sparsity_ratio", "gate_confidence", "activation_stability_pct", "gate_entropy"):
        torch.testing.assert_close(
            getattr(b, name), getattr(a, name), rtol=1e-4, atol=1e-5, msg=name
        )
    for name in ("sparsity_per_layer", "silence_rate_per_layer", "step_sparsity"):
        torch.testing.assert_close(
            getattr(b, name), getattr(a, name), rtol=1e-4, atol=1e-5, msg=name
        )
    assert a.answer_channels is not None and b.answer_channels is not None
    for x, y in zip(b.answer_channels, a.answer_channels, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert alone.readout is not None and batched.readout is not None
    for name in ("hidden", "lookback", "entropy"):
        got, want = getattr(batched.readout, name), getattr(alone.readout, name)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize(
    "path", ["native", "native-row-by-row", "fallback", "reference", "native-bfloat16"]
)
def test_batched_requests_match_the_same_requests_alone(
    family: str, path: str, scheduler: Scheduler
) -> None:
    """bfloat16 weights: a batch's bfloat16 product (where the processor has one) and a row
    alone on the compiled kernel both multiply the input rounded to bfloat16."""
    base, _, dtype = path.removesuffix("-row-by-row").partition("-")
    engine = _engine(family, base, dtype or "float32")
    if path.endswith("row-by-row"):  # each row's step on the compiled kernel, in its slot
        scheduler.batch_from = 99
    every_role = _every_role_plan(engine)
    jobs: list[tuple[GenerationRequest, Any]] = [
        (_request(i), level) for i, level in enumerate(LEVELS)
    ]
    jobs.append((_request(2, max_new_tokens=9), every_role))
    alone = [engine.generate(request, level).result() for request, level in jobs]
    sinks = _together(scheduler, engine, jobs)
    for want, sink in zip(alone, sinks, strict=True):
        _same(want, sink.result())
    # Every one had begun before any had ended: they ran together.
    assert max(sink.began for sink in sinks) < min(sink.ended for sink in sinks)
    if path == "reference":  # reference sequences step one after another, unbatched
        assert scheduler.steps == 0
        assert all(sink.result().batch_size == 1.0 for sink in sinks)
    else:
        assert scheduler.rows / scheduler.steps > 2  # several rows per batched step
        assert all(sink.result().batch_size > 1 for sink in sinks)
        assert scheduler.packed == len(jobs)  # their prompts prefilled in one packed pass


def _every_role_plan(engine: Engine) -> SparsityPlan:
    """A pinned plan with thresholds on every projection, k and gate apart from the rest (the
    fused matrices then run part by part)."""
    down = engine.plan(Level.BALANCED).thresholds["down"]
    scale = {"q": 0.02, "k": 0.03, "v": 0.02, "o": 0.01, "gate": 0.01, "up": 0.02}
    thresholds = {role: tuple(s for _ in down) for role, s in scale.items()}
    return SparsityPlan(Level.BALANCED, {**thresholds, "down": down}, calibration_version="all")


def test_a_full_waiting_queue_is_refused(scheduler: Scheduler) -> None:
    engine = _engine("llama", "fallback")
    scheduler.max_waiting = 2
    scheduler.call(lambda: scheduler.attach(engine)).result()
    gate = threading.Event()
    scheduler.call(gate.wait)
    sinks = [Collect(), Collect()]
    for sink in sinks:
        scheduler.submit(_request(0), Level.BALANCED, sink)
    assert scheduler.depth == 2
    with pytest.raises(QueueFullError):
        scheduler.submit(_request(0), Level.BALANCED, Collect())
    with pytest.raises(QueueFullError):
        scheduler.probe(
            Probe([{"role": "user", "content": "hi"}], [5], False), Level.BALANCED, Collect()
        )
    gate.set()
    assert all(sink.result().completion_tokens == 6 for sink in sinks)
    assert scheduler.depth == 0


def test_a_cancelled_request_leaves_and_the_others_go_on(scheduler: Scheduler) -> None:
    engine = _engine("llama", "native")
    scheduler.call(lambda: scheduler.attach(engine)).result()
    gate = threading.Event()
    scheduler.call(gate.wait)
    long, other = Collect(), Collect()
    ticket = scheduler.submit(_request(0, max_new_tokens=200), Level.BALANCED, long)
    scheduler.submit(_request(1, max_new_tokens=40), Level.BALANCED, other)
    gate.set()
    while len(long.deltas) < 3:
        assert not long.over.wait(0.01)
    ticket.cancelled.set()
    stats = long.result()
    assert stats.finish_reason == "cancelled"
    assert stats.completion_tokens < 200
    assert other.result().completion_tokens == 40
    alone = engine.generate(_request(1, max_new_tokens=40), Level.BALANCED).result()
    assert other.result().token_ids == alone.token_ids


def test_the_token_budget_holds_a_request_back_until_one_leaves(scheduler: Scheduler) -> None:
    engine = _engine("llama", "native")
    scheduler.kv_tokens = 80
    jobs: list[tuple[GenerationRequest, Any]] = [
        (_request(0, max_new_tokens=30), Level.BALANCED),
        (_request(1, max_new_tokens=30), Level.BALANCED),
    ]
    first, second = (sink.result() for sink in _together(scheduler, engine, jobs))
    assert first.batch_size == 1.0 and second.batch_size == 1.0  # one after the other
    scheduler.kv_tokens = 8192
    jobs = [(_request(0, max_new_tokens=30), Level.BALANCED)] * 2
    assert all(sink.result().batch_size == 2.0 for sink in _together(scheduler, engine, jobs))


def test_drift_passes_batch_and_match_one_by_one(scheduler: Scheduler) -> None:
    engine = _engine("qwen2", "native")
    jobs: list[tuple[GenerationRequest, Any]] = [
        (_request(i, measure_drift=True, max_new_tokens=8), Level.AGGRESSIVE) for i in range(3)
    ]
    batched = [sink.result() for sink in _together(scheduler, engine, jobs)]
    alone = [engine.generate(request, level).result() for request, level in jobs]
    for got, want in zip(batched, alone, strict=True):
        assert want.semantic_drift_kl is not None and want.semantic_drift_kl > 0
        # the tiny model's drift is ~1e-6, the float noise of its logits: a change in how the
        # products round moves it by ~1e-7 (the blocked oneDNN weights did)
        assert got.semantic_drift_kl == pytest.approx(want.semantic_drift_kl, abs=3e-7)
    # The padded pass against one pass per answer, on sparse logits far from the dense ones.
    generator = torch.Generator().manual_seed(0)
    items = [
        (
            engine.encode_text(PROMPTS[i]),
            [5 + i, 7, 9, 11][: 2 + i],
            torch.randn(2 + i, engine.vocab_size, generator=generator),
        )
        for i in range(3)
    ]
    many = engine.semantic_drift_many(items)
    one_by_one = [engine.semantic_drift(*item) for item in items]
    assert min(one_by_one) > 0.1
    assert many == pytest.approx(one_by_one, rel=1e-4)


def test_a_bad_request_fails_alone(scheduler: Scheduler) -> None:
    engine = _engine("llama", "native")
    jobs: list[tuple[GenerationRequest, Any]] = [(_request(0), Level.BALANCED)]
    scheduler.call(lambda: scheduler.attach(engine)).result()
    bad, good = Collect(), Collect()
    too_long = GenerationRequest(prompt="x", max_new_tokens=10**6)
    scheduler.submit(too_long, Level.BALANCED, bad)
    scheduler.submit(*jobs[0], good)
    assert bad.over.wait(30) and isinstance(bad.failure, ValueError)
    assert good.result().completion_tokens == 6


def test_probes_batched_match_each_probe_alone(family: str, scheduler: Scheduler) -> None:
    """Proxy probes waiting together run as one right-padded pass (per plan), with each
    answer's signals, log-probabilities, readout and drift as a pass of its own gives."""
    engine = _engine(family, "reference")
    answers = [
        "Four, of course, as every child knows.",
        "It is sunny and warm, with a light breeze.",
        "The sea was grey and the wind blew hard.",
    ]
    probes = [
        Probe([{"role": "user", "content": PROMPTS[i]}], engine.encode_text(a), True, a)
        for i, a in enumerate(answers)
    ]
    assert len({len(p.answer_ids) for p in probes}) == 3  # unequal rows: padded, one batch
    alone = [score_many(engine, [p], Level.AGGRESSIVE, readout=True)[0] for p in probes]
    scheduler.call(lambda: scheduler.attach(engine)).result()
    gate = threading.Event()
    scheduler.call(gate.wait)
    sinks = [Collect() for _ in probes]
    for probe, sink in zip(probes, sinks, strict=True):
        scheduler.probe(probe, Level.AGGRESSIVE, sink, readout=True)
    gate.set()
    for want, sink in zip(alone, sinks, strict=True):
        got = sink.result()
        assert got.batch_size == 3.0  # one pass
        assert got.token_ids == want.token_ids and got.text == want.text
        _same(want, got)
        assert got.semantic_drift_kl == pytest.approx(want.semantic_drift_kl, abs=1e-6)


def test_a_shared_prefix_is_reused_under_the_same_plan_only(scheduler: Scheduler) -> None:
    """Prefix reuse works through the scheduler as alone: a later request with the same system
    prompt reuses its KV at the same level (with the tokens and signals of an uncached
    prefill), and not at another level (a mismatch), both prefilled in one packed pass."""
    engine = tiny_engine(cache=True)
    engine.enable_fast_path("float32", kernels.load(), max_len=256)
    system = {"role": "system", "content": "You are terse. " * 6}

    def ask(text: str, **extra: Any) -> GenerationRequest:
        messages = [system, {"role": "user", "content": text}]
        return GenerationRequest(messages=messages, max_new_tokens=5, ignore_eos=True, **extra)

    cold = engine.generate(ask("hello", use_prefix_cache=False), Level.BALANCED).result()
    first, *_ = _together(scheduler, engine, [(ask("a question"), Level.BALANCED)])
    warm, other = _together(
        scheduler, engine, [(ask("hello"), Level.BALANCED), (ask("hello"), Level.AGGRESSIVE)]
    )
    assert first.result().cached_tokens == 0
    assert warm.result().cached_tokens > 0 and warm.result().token_ids == cold.token_ids
    assert other.result().cached_tokens == 0 and other.result().cache_mismatch
    assert scheduler.packed == 2  # the last two prefilled packed, each after its own prefix
    got, want = warm.result().signals, cold.signals
    assert got is not None and want is not None
    for name in ("sparsity_per_layer", "silence_rate_per_layer", "step_sparsity"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-4, atol=1e-5)


def test_a_denormal_temperature_samples_the_top_token() -> None:
    """A temperature just above 0 (the gateway accepts any float > 0) divides the logits past
    float range: the choice is greedy, never a NaN probability."""
    logits = torch.tensor([0.3, -0.2, 1.5, 1.4])
    assert sample_next(logits, 5e-324, 5e-324, None) == 2
    assert sample_next(logits, 1e-300, 1.0, None, top_k=2) == 2


def test_a_request_whose_sampling_fails_fails_alone(
    scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error choosing one sequence's token (at its first token or in a batched step) fails
    that request only; the others finish and the scheduler keeps serving."""
    engine = _engine("llama", "native")

    def sample(logits: torch.Tensor, temperature: float, *rest: Any) -> int:
        if temperature == 0.5:
            raise RuntimeError("sampling failed")
        return int(logits.argmax())

    monkeypatch.setattr("sparse_engine.runtime.sequence.sample", sample)
    jobs: list[tuple[GenerationRequest, Any]] = [
        (_request(0), Level.BALANCED),
        (_request(1, temperature=0.5), Level.BALANCED),
        (_request(2), Level.DENSE),
    ]
    sinks = _submit_together(scheduler, engine, jobs)
    assert sinks[1].over.wait(60) and isinstance(sinks[1].failure, RuntimeError)
    assert sinks[0].result().completion_tokens == 6 and sinks[2].result().completion_tokens == 12
    after = Collect()
    scheduler.submit(_request(3), Level.BALANCED, after)
    assert after.result().completion_tokens == 15


def test_generate_all_returns_each_answer_in_order_and_raises_a_failed_one() -> None:
    engine = _engine("llama", "native")  # the fast path: its sequences step as one batch
    prompts = ["The river", "A small house", "Numbers like", "In the morning", "Green fields"]
    jobs = [
        (GenerationRequest(prompt=p, max_new_tokens=6, ignore_eos=True), level)
        for p, level in zip(prompts, [Level.DENSE, Level.BALANCED] * 3, strict=False)
    ]
    done: list[int] = []
    found = generate_all(engine, jobs, max_batch=4, progress=done.append)
    alone = [engine.generate(request, level).result() for request, level in jobs]
    assert [s.token_ids for s in found] == [s.token_ids for s in alone]
    assert [s.level for s in found] == [level.value for _, level in jobs]
    assert sum(done) == len(jobs) and max(s.batch_size for s in found) > 1
    again = generate_all(engine, jobs, max_batch=4)  # the same list makes the same batches
    assert [s.token_ids for s in again] == [s.token_ids for s in found]
    too_long = GenerationRequest(prompt="x", max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_all(engine, [jobs[0], (too_long, Level.DENSE)])
