"""Trust on the real SmolLM2: a retrieved passage reaches the model and changes its answer, and
`trust fit` / `eval trust` run end to end on a small QA file."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.cli import main
from services.storage.kb import Passage
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.engine import Engine
from tests.gateway_fixtures import RecordingSink, running_gateway
from tests.test_trust_gateway import (
    FACT,
    QUESTION,
    distrustful_model,
    settings_for,
    with_knowledge,
)

pytestmark = pytest.mark.slow

QA = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What colour is the sky on a clear day?", "answers": ["blue"]},
    {
        "question": "Who wrote the novel in the passage?",
        "context": "The novel Zorblax was written by Mira Tendel in 1931.",
        "answer": "Mira Tendel",
    },
    {"question": "What is the square root of 1369?", "answer": "37"},
    {"question": "Which planet is the largest in the solar system?", "answer": "Jupiter"},
    {"question": "What is the chemical symbol of gold?", "answer": "Au"},
]


def test_retrieval_puts_the_fact_into_smollm_s_answer(
    smollm: LoadedModel, calibrated_store: CalibrationStore, tmp_path: Path
) -> None:
    engine = Engine(smollm, calibrated_store.latest_plans(smollm.weights_sha256))
    distrustful_model(tmp_path, smollm.model_id)
    settings = settings_for(tmp_path, default_action="retrieve")
    with_knowledge(settings, [Passage("notes", "Lighthouse", FACT)])
    with running_gateway(settings, engine, RecordingSink()) as url:
        body = {
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24,
            "temperature": 0,
            "ir_sparse_level": "dense",
        }
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert "action=retrieve" in response.headers["x-ir-trust"]
    assert "marmalade" in response.json()["choices"][0]["message"]["content"].lower()


def test_trust_fit_and_eval_cli_on_a_qa_file(
    cli_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qa = cli_home / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(row) for row in QA))
    common = ["--data", str(qa), "--max-new-tokens", "12"]
    assert main(["trust", "fit", *common, "--n", "6"]) == 0
    assert "trust model trust-balanced-" in capsys.readouterr().out
    assert main(["eval", "trust", *common, "--n", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 6 and report["held_out"] is False  # evaluated on its own fit data
    assert 0 < report["right"] < 6
    names = {row["name"] for row in report["rows"]}
    assert {"trust_score", "late_silence", "mean_logprob", "answer_length"} <= names
    records = list((cli_home / "trust" / "records").glob("*.jsonl"))
    assert len(records) == 1 and len(records[0].read_text().splitlines()) == 6  # reused
    assert main(["eval", "trust", "--data", str(qa), "--n", "7"]) == 2
    assert "reaches past the end" in capsys.readouterr().err
