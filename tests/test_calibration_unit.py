"""The calibration pipeline end to end on a tiny model: data split, level search, artefact."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from services.cli.calibration import describe
from sparse_engine.calibration.pipeline import (
    STEADY_HELDOUT_DOCUMENTS,
    CalibrationConfig,
    LevelSearch,
    calibrate,
    prepare_data,
)
from sparse_engine.calibration.store import CalibrationNotFoundError, CalibrationStore
from sparse_engine.data.splits import calibration_split
from sparse_engine.evaluation.perplexity import PerplexityResult, perplexity, t_quantile
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.sparsity.plan import Level, SparsityPlan
from tests.tiny import sample_texts, tiny_model

CFG = CalibrationConfig(
    samples=6, seq_len=96, heldout_tokens=256, heldout_doc_tokens=96, max_rows=64
)


def test_prepare_data_keeps_samples_and_heldout_disjoint() -> None:
    lm = tiny_model()
    texts = sample_texts(12)
    data = prepare_data(lm.tokenizer, texts, CFG, "tiny")
    assert len(data.batches) == 6 and data.heldout.numel() == 256
    with pytest.raises(ValueError, match="lower --samples"):
        prepare_data(lm.tokenizer, texts[:3], CFG, "tiny")


def test_heldout_documents_are_cut_at_a_middle_window_and_none_is_a_sample() -> None:
    """One long document cannot fill the held-out text: each gives its middle window, so
    the held-out tokens come from several documents, none of them among the samples."""
    # 12 documents of 801 characters, each named by a letter that also fills its middle
    # (characters 351..450)
    texts = [n + "x" * 350 + n * 100 + "y" * 350 for n in "ABCDEFGHIJKL"]

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    batches, heldout, _ = calibration_split(
        encode,
        texts,
        samples=4,
        seq_len=64,
        min_tokens=8,
        heldout_tokens=256,
        heldout_doc_tokens=96,
    )
    assert [len(d) for d in heldout] == [96, 96, 64]
    heldout_names = [set(d) for d in heldout]
    assert all(len(names) == 1 for names in heldout_names)  # the middle window, nothing else
    assert len(batches) == 4 and all(len(b) == 64 for b in batches)
    sample_names = {b[0] for b in batches}  # each sample starts at its document's start
    assert len(sample_names) == 4 and not sample_names & set().union(*heldout_names)
    lm = tiny_model()
    data = prepare_data(lm.tokenizer, sample_texts(12), CFG, "tiny")
    assert sum(data.documents) == data.heldout.numel() == 256
    assert len(data.documents) > 1 and max(data.documents) <= CFG.heldout_doc_tokens


def test_heldout_documents_group_the_scored_tokens() -> None:
    """The held-out text is scored as one stream, as before; its documents only group the
    scored tokens (the first token of the stream is never scored) for the standard error."""
    lm = tiny_model()
    data = prepare_data(lm.tokenizer, sample_texts(12), CFG, "tiny")
    got = perplexity(
        lm.model, lm.layers, data.heldout, SparsityPlan(), chunk=48, documents=data.documents
    )
    flat = perplexity(lm.model, lm.layers, data.heldout, SparsityPlan(), chunk=48)
    first, *rest = data.documents
    assert got.documents == (first - 1, *rest) and flat.documents == ()
    assert torch.equal(got.token_nll, flat.token_nll) and sum(got.documents) == got.num_tokens
    with pytest.raises(ValueError, match="documents hold"):
        perplexity(lm.model, lm.layers, data.heldout, SparsityPlan(), documents=(3, 4))


def test_a_bos_prefix_comes_before_every_sample_and_scored_chunk() -> None:
    """A model whose tokenizer starts text with <bos> (Gemma) is calibrated and scored as it
    is served: each sample and each perplexity chunk after <bos>, which is not scored."""
    lm = tiny_model()
    bos = lm.tokenizer.eos_token_id  # the byte tokenizer's only special token stands in
    lm.tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", bos)]
    )
    assert lm.bos_prefix == (bos,)
    data = prepare_data(lm.tokenizer, sample_texts(12), CFG, "tiny")
    assert data.prefix == (bos,) and all(int(b[0, 0]) == bos for b in data.batches)
    ids = data.heldout[:97]
    got = perplexity(lm.model, lm.layers, ids, SparsityPlan(), chunk=48, prefix=(bos,))
    nll = []
    with torch.inference_mode():
        for start in (0, 48):
            chunk = ids[start : start + 49]
            logits = lm.model(input_ids=torch.cat([torch.tensor([bos]), chunk[:-1]])[None]).logits
            nll.append(
                torch.nn.functional.cross_entropy(logits[0, 1:], chunk[1:], reduction="none")
            )
    assert got.num_tokens == 96
    assert got.perplexity == pytest.approx(math.exp(float(torch.cat(nll).mean())), rel=1e-5)
    plain = perplexity(lm.model, lm.layers, ids, SparsityPlan(), chunk=48)
    assert plain.perplexity != pytest.approx(got.perplexity, rel=1e-6)


def test_calibrate_stays_within_budgets_and_round_trips(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lm = tiny_model()
    data = prepare_data(lm.tokenizer, sample_texts(12), CFG, "tiny")
    levels = [Level.CONSERVATIVE, Level.AGGRESSIVE]
    with caplog.at_level(logging.WARNING, logger="sparse_engine.calibration.pipeline"):
        results = calibrate(lm, data, levels, CFG)
    # a handful of held-out documents is said to be one, with the fix
    assert len(data.documents) < STEADY_HELDOUT_DOCUMENTS
    assert f"only {len(data.documents)} held-out documents" in caplog.text
    assert "--heldout-tokens 4096" in caplog.text
    store = CalibrationStore(tmp_path)
    for cal in results:
        assert cal.perplexity_change_pct <= cal.budget_pct
        assert len(cal.thresholds["down"]) == lm.num_layers
        # the bound that met the budget is kept and shown (pooled: no parts)
        bound = cal.data.get("bound_pct", 0.0)
        if cal.realised_sparsity > 0:
            assert cal.perplexity_change_pct <= bound <= cal.budget_pct
            assert f"bound {bound:+.2f}%, budget" in describe(cal)
        assert "part_bounds_pct" not in cal.data
        store.save(cal)
    conservative, aggressive = results
    assert aggressive.realised_sparsity >= conservative.realised_sparsity
    assert aggressive.realised_sparsity > 0 and "bound_pct" in aggressive.data  # checked above
    loaded = store.load(conservative.version)
    assert loaded == conservative
    # oldest first: by creation time (a second apart when the clock ticks between them), then name
    listed = [c.version for c in store.list(lm.weights_sha256)]
    assert listed == [c.version for c in sorted(results, key=lambda c: (c.created_at, c.version))]
    engine = Engine(lm, store.latest_plans(lm.weights_sha256))
    stats = engine.generate(
        GenerationRequest(prompt="Doc", max_new_tokens=4), Level.AGGRESSIVE
    ).result()
    assert stats.calibration_version == aggressive.version
    with pytest.raises(CalibrationNotFoundError):
        engine.generate(GenerationRequest(prompt="Doc"), Level.BALANCED)
    assert not list(tmp_path.glob("*.tmp"))


def test_topk_calibration_picks_k_within_budget() -> None:
    lm = tiny_model()
    cfg = CalibrationConfig(samples=6, seq_len=96, heldout_tokens=256, sparsifier="topk")
    data = prepare_data(lm.tokenizer, sample_texts(12), cfg, "tiny")
    (cal,) = calibrate(lm, data, [Level.BALANCED], cfg)
    assert cal.topk is not None and len(cal.topk) == lm.num_layers
    assert cal.perplexity_change_pct <= 2.0
    inputs = data.heldout.numel() - 1  # scored in chunks of 512, each from position 0, dense
    chunks = math.ceil(inputs / 512)
    expected = (1 - cal.topk[0] / 64) * (inputs - chunks) / inputs
    assert cal.realised_sparsity == pytest.approx(expected, abs=1e-6)


def test_paired_change_and_its_upper_bound() -> None:
    dense = PerplexityResult(1.0, 0.0, 4, torch.tensor([1.0, 2.0, 1.0, 2.0], dtype=torch.float64))
    sparse_nll = dense.token_nll + torch.tensor([0.0, 0.02, 0.0, 0.02], dtype=torch.float64)
    sparse = PerplexityResult(1.0, 0.5, 4, sparse_nll)
    point = sparse.change_pct(dense)
    assert point == pytest.approx(100 * (math.exp(0.01) - 1))
    se = float(torch.tensor([0.0, 0.02, 0.0, 0.02]).std()) / 2
    assert sparse.change_pct(dense, z=1.0) == pytest.approx(100 * (math.exp(0.01 + se) - 1))
    assert sparse.change_pct(dense, z=1.0) > point


def test_the_margin_counts_documents_not_tokens() -> None:
    """Two documents, one hurt and one not: per token the differences look like many
    independent draws; by document there are two, and the margin is wider."""
    dense_nll = torch.zeros(8, dtype=torch.float64)
    diff = torch.tensor([0.02] * 4 + [0.0] * 4, dtype=torch.float64)
    dense = PerplexityResult(1.0, 0.0, 8, dense_nll, (4, 4))
    sparse = PerplexityResult(1.0, 0.5, 8, dense_nll + diff, (4, 4))
    # cluster-robust: sum of deviations per document is +0.04 and -0.04
    se = math.sqrt(2 / 1 * (0.04**2 + 0.04**2)) / 8
    t = t_quantile(1.0, 1)  # Student's t with one degree of freedom, at the level of z = 1
    assert sparse.change_pct(dense, z=1.0) == pytest.approx(100 * (math.exp(0.01 + t * se) - 1))
    per_token = float(diff.std()) / math.sqrt(8)
    assert se > per_token and t > 1.0
    tokens = PerplexityResult(1.0, 0.5, 8, dense_nll + diff)
    assert tokens.change_pct(dense, z=1.0) == pytest.approx(100 * (math.exp(0.01 + per_token) - 1))


@pytest.mark.parametrize(
    ("df", "table"), [(2, 2.920), (3, 2.353), (5, 2.015), (19, 1.729), (100, 1.660)]
)
def test_the_margin_over_few_documents_is_students_t(df: int, table: float) -> None:
    """The one-sided 95 % quantile of t with df degrees of freedom, from the normal one."""
    assert t_quantile(1.6448536, df) == pytest.approx(table, rel=3e-3)


def test_a_mixed_corpus_per_source_gets_equal_heldout_shares_and_the_worst_bound() -> None:
    """With --per-source each part of a mixed corpus gives an equal share of the held-out
    text, no held-out document is a sample, and a level's bound is the worst part's."""
    texts = [n + "x" * 350 + n * 100 + "y" * 350 for n in "ABCDEFGHIJKLMNOP"]
    sources = [0 if n in "ABCDEFGH" else 1 for n in "ABCDEFGHIJKLMNOP"]

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    def split(
        sources: list[int] | None = None,
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        return calibration_split(
            encode,
            texts,
            samples=4,
            seq_len=64,
            min_tokens=8,
            heldout_tokens=300,
            heldout_doc_tokens=96,
            sources=sources or (),
        )

    batches, heldout, kinds = split(sources)
    names = [d[0] for d in heldout]
    by_source = {
        k: sum(len(d) for d, s in zip(heldout, kinds, strict=True) if s == k) for k in (0, 1)
    }
    assert by_source == {0: 150, 1: 150} and sorted(set(kinds)) == [0, 1]
    assert all(
        sources["ABCDEFGHIJKLMNOP".index(chr(n))] == k for n, k in zip(names, kinds, strict=True)
    )
    assert not {b[0] for b in batches} & set(names)
    _, plain_heldout, plain_kinds = split()
    assert plain_kinds == [0] * len(plain_heldout)  # no sources: one part, as before

    lm = tiny_model()
    mixed = [t for pair in zip(sample_texts(12), sample_texts(24)[12:], strict=True) for t in pair]
    labels = [i % 2 for i in range(len(mixed))]
    data = prepare_data(lm.tokenizer, mixed, CFG, "one+two", labels)
    assert data.source_names == ("one", "two") and len(data.sources) == len(data.documents)
    assert data.sources.count(0) > 0 and data.sources.count(1) > 0
    (cal,) = calibrate(lm, data, [Level.AGGRESSIVE], CFG)
    assert cal.data["heldout_sources"] == {
        "one": data.sources.count(0),
        "two": data.sources.count(1),
    }
    plan = cal.plan()
    dense = data.heldout_perplexity(lm, SparsityPlan())
    sparse = data.heldout_perplexity(lm, plan)
    bounds = []
    for index in (0, 1):
        keep = [s == index for s in data.sources]
        part = sparse.subset(keep)
        assert part.num_tokens == sum(n for n, k in zip(sparse.documents, keep, strict=True) if k)
        bounds.append(part.change_pct(dense.subset(keep), CFG.confidence_z))
    assert max(bounds) <= cal.budget_pct  # the worst part holds the budget
    kept = cal.data["part_bounds_pct"]  # what decided the level, kept and shown
    assert kept == pytest.approx(dict(zip(("one", "two"), bounds, strict=True)), abs=1e-3)
    assert cal.data["bound_pct"] == pytest.approx(max(bounds), abs=1e-3)
    worst = max(kept, key=kept.__getitem__)
    assert f"bound {cal.data['bound_pct']:+.2f}% {worst}, budget" in describe(cal)
    # the search's bound is the worst part's, not the pooled one
    search = LevelSearch("fixed", lm, data, dense, lambda _: plan, CFG.confidence_z)
    assert search.upper_pct(0.5) == pytest.approx(max(bounds))
    assert max(bounds) != pytest.approx(sparse.change_pct(dense, CFG.confidence_z))
    everything = sparse.subset([True] * len(sparse.documents))
    assert torch.equal(everything.token_nll, sparse.token_nll)
    assert everything.perplexity == pytest.approx(sparse.perplexity)
