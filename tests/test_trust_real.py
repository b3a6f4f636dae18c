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
from sparse_engine.trust.qa import SPLITS, load_qa, qa_sample
from tests.gateway_fixtures import RecordingSink, running_gateway
from tests.test_trust_gateway import (
    FACT,
    QUESTION,
    distrustful_model,
    settings_for,
    with_knowledge,
)

pytestmark = pytest.mark.slow

EASY = [
    ("What is the capital of France?", "Paris"),
    ("What colour is the sky on a clear day?", "blue"),
    ("Which planet is the largest in the solar system?", "Jupiter"),
    ("How many days are in a week?", "seven"),
    ("What is the opposite of hot?", "cold"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is frozen water called?", "ice"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What colour is grass?", "green"),
    ("What is the capital of Italy?", "Rome"),
    ("What animal says moo?", "cow"),
]
# Questions nobody can answer: wrong answers in both halves of the file.
HARD = [(f"What is the seven-digit code printed on ticket {n}?", "4471902") for n in range(12)]
QA = [{"question": q, "answer": a} for q, a in EASY + HARD]


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


def main_out(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert main(args) == 0
    return capsys.readouterr().out


def test_trust_fit_and_eval_cli_on_a_qa_file(
    cli_home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPARSEGUARD_TRUST__FLAG_REQUESTS", "20")  # healthy chat per level
    monkeypatch.setenv("SPARSEGUARD_TRUST__FLAG_KINDS", '["chat"]')
    qa = cli_home / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(row) for row in QA))
    common = ["--data", str(qa), "--max-new-tokens", "12", "--n", str(len(QA) // 2)]
    fit_half, eval_half = (
        len(qa_sample(load_qa(str(qa), cli_home), s, len(QA) // 2)) for s in SPLITS
    )
    assert main(["trust", "fit", *common]) == 0
    out = capsys.readouterr().out
    assert "trust model trust-serve-balanced-" in out and f"{fit_half} answers" in out
    assert "(nested, choice included: " in out and "; chance reaches " in out
    assert main(["eval", "trust", *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == eval_half and report["held_out"] is True  # the other half
    assert 0 < report["right"] < eval_half
    names = {row["name"] for row in report["rows"]}
    assert {"trust_score", "in_passage", "min_logprob", "answer_length"} <= names
    assert main(["eval", "trust", *common, "--split", "fit", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["held_out"] is False  # its own fit data
    records = list((cli_home / "trust" / "records").glob("*.jsonl"))
    assert len(records) == 1 and len(records[0].read_text().splitlines()) == len(QA)  # reused
    pooled = ["--data", f"{qa}+{qa}", *common[2:], "--split", "fit", "--json"]
    assert main(["eval", "trust", *pooled]) == 0  # sets joined by '+': n items of each
    assert json.loads(capsys.readouterr().out)["n"] == 2 * fit_half
    assert main(["eval", "trust", *common, "--upstream", "SmolLM2-135M-Instruct"]) == 2
    assert "add --mode proxy" in capsys.readouterr().err
    report = json.loads(main_out(capsys, ["eval", "trust", *common, "--json"]))
    assert 0 < report["mean_trust"] < 1 and 0 <= report["brier"] <= 1
    # A fit asked for a level that has a model, with --if-missing, fits nothing; one asked
    # for a level twice is refused before the model loads.
    assert main(["trust", "fit", *common, "--level", "balanced", "--if-missing"]) == 0
    assert "exists for balanced; skipped" in capsys.readouterr().out
    assert len(list((cli_home / "trust").glob("trust-*.json"))) == 1
    assert main(["trust", "fit", *common, "--level", "dense,Dense"]) == 2
    assert "names a level twice" in capsys.readouterr().err
    # Answers that cannot be fit (every one wrong): no model at either level, and a failure.
    nonsense = cli_home / "nonsense.jsonl"
    nonsense.write_text("\n".join(json.dumps({**row, "answer": "zzqx"}) for row in QA))
    unfit = ["--data", str(nonsense), *common[2:], "--level", "dense,balanced"]
    assert main(["trust", "fit", *unfit]) == 1
    assert "no trust model at dense, balanced" in capsys.readouterr().out
    assert main(["trust", "fit", *common, "--level", "balanced,conservative"]) == 2  # none here
    assert "run `sparseguard calibrate --level conservative`" in capsys.readouterr().err
