"""lm-evaluation-harness (`lm-eval` from PyPI) against the gateway on loopback, with the small
task files in tests/lm_eval_tasks: a log-likelihood task through `local-completions` (legacy
completions with echo and logprobs) and a generate-until task through
`local-chat-completions`. What it reports is checked against the engine run directly."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.sparsity.plan import Level
from tests.gateway_fixtures import RecordingSink, running_gateway, settings_for
from tests.tiny import tiny_engine

TASKS = Path(__file__).with_name("lm_eval_tasks")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_engine()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> Iterator[str]:
    home = tmp_path_factory.mktemp("home")
    with running_gateway(settings_for(home), engine, RecordingSink()) as base:
        yield base


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> TaskManager:
    """The task files with their data paths made absolute (lm-eval reads them from the cwd)."""
    folder = tmp_path_factory.mktemp("tasks")
    for yaml in TASKS.glob("*.yaml"):
        text = yaml.read_text().replace("tests/lm_eval_tasks/", f"{TASKS}/")
        (folder / yaml.name).write_text(text)
    return TaskManager(include_path=str(folder))


def _docs(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


def test_loglikelihood_task_through_legacy_completions(
    url: str, engine: Engine, tasks: TaskManager, tmp_path: Path
) -> None:
    tokenizer = tmp_path / "tokenizer"
    engine.lm.tokenizer.save_pretrained(tokenizer)
    results = simple_evaluate(
        model="local-completions",
        model_args=(
            f"model=tiny-llama,base_url={url}/v1/completions,tokenizer={tokenizer},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
        ),
        tasks=["sg_choice"],
        task_manager=tasks,
        log_samples=True,
    )
    assert results is not None
    reported = results["results"]["sg_choice"]["acc,none"]
    # Directly: each choice's log-likelihood under the gateway's default level (balanced).
    plan = engine.plan(Level.BALANCED)
    right = 0
    samples = sorted(results["samples"]["sg_choice"], key=lambda s: s["doc_id"])
    for doc, sample in zip(_docs("sg_choice.jsonl"), samples, strict=True):
        scores = []
        for choice in doc["choices"]:
            context = engine.encode_text(doc["question"])
            ids = context + engine.encode_text(" " + choice)  # lm-eval's target delimiter
            logprobs, _ = engine.prompt_logprobs(ids, plan)
            scores.append(sum(lp for lp in logprobs[len(context) :] if lp is not None))
        gateway = [float(r[0][0]) for r in sample["resps"]]
        assert gateway == pytest.approx(scores, abs=1e-3)
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert math.isclose(reported, right / len(samples))


def test_generate_until_task_through_chat_completions(
    url: str, engine: Engine, tasks: TaskManager
) -> None:
    results = simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=tiny-llama,base_url={url}/v1/chat/completions,num_concurrent=1",
        tasks=["sg_answer"],
        task_manager=tasks,
        apply_chat_template=True,
        log_samples=True,
    )
    assert results is not None
    samples = sorted(results["samples"]["sg_answer"], key=lambda s: s["doc_id"])
    matches = 0
    for doc, sample in zip(_docs("sg_answer.jsonl"), samples, strict=True):
        messages = [{"role": "user", "content": doc["question"]}]
        request = GenerationRequest(
            messages=messages, max_new_tokens=8, temperature=0.0, stop=("\n",)
        )
        generation = engine.generate(request, Level.BALANCED)
        direct = "".join(generation)
        assert sample["resps"][0][0] == direct
        matches += direct.strip() == doc["answer"]
    assert results["results"]["sg_answer"]["exact_match,none"] == matches / len(samples)
