"""Silence map on a tiny Llama with planted dead and bias-like channels: the rule finds exactly
them, ablation confirms them, protection and critical rules hold, and the artefacts render."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.cli import main
from services.cli.silence import summary
from services.cli.silence_render import png_size, render_html, render_png
from sparse_engine.calibration.pipeline import CalibrationConfig, CalibrationData, prepare_data
from sparse_engine.compression.silence import (
    ChannelSite,
    ChannelStats,
    SilenceMap,
    SilenceRule,
    diff,
    flag_silent,
)
from sparse_engine.compression.silence_map import build_map, channels_zeroed, read_critical
from sparse_engine.model.loader import LoadedModel, wrap
from tests.tiny import byte_tokenizer, sample_texts

NUM_LAYERS = 4
DEAD_MLP = {0: [3, 50], 1: [7], 3: [11]}  # layer 3 is protected (protect_last=1)
DEAD_V_ROW = 5  # v_proj row 5 of kv head 0 feeds o_proj inputs 5 and 21 (query heads 0, 1)
BIAS_CHANNEL = (2, 99)
RULE = SilenceRule(protect_last=1)
Built = tuple[SilenceMap, dict[ChannelSite, torch.Tensor]]


def planted_model() -> LoadedModel:
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        mlp_bias=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer, channels in DEAD_MLP.items():
            model.model.layers[layer].mlp.gate_proj.weight[channels] = 0.0  # silu(0) * up = 0
        model.model.layers[1].self_attn.v_proj.weight[DEAD_V_ROW] = 0.0
        layer, channel = BIAS_CHANNEL
        mlp = model.model.layers[layer].mlp
        mlp.gate_proj.weight[channel] = 0.0
        mlp.gate_proj.bias[channel] = 8.0
        mlp.up_proj.weight[channel] = 0.0
        mlp.up_proj.bias[channel] = 4.0  # constant silu(8) * 4 ~ 32
        # Keep it out of the residual stream: a 32 there would quiet later layers' channels.
        mlp.down_proj.weight[:, channel] = 0.0
    return wrap(model, tokenizer, "tiny-planted", "planted-0")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return planted_model()


@pytest.fixture(scope="module")
def data(lm: LoadedModel) -> CalibrationData:
    cfg = CalibrationConfig(samples=8, seq_len=96, min_tokens=16, heldout_tokens=256)
    return prepare_data(lm.tokenizer, sample_texts(16), cfg, "tiny-text")


@pytest.fixture(scope="module")
def built(lm: LoadedModel, data: CalibrationData) -> Built:
    return build_map(lm, data, RULE)


def test_rule_finds_exactly_the_planted_channels(built: Built) -> None:
    smap, _ = built
    flagged = {lm.layer: lm.mlp.flagged for lm in smap.layers if lm.mlp.flagged}
    assert flagged == DEAD_MLP
    attn = {lm.layer: lm.attn.flagged for lm in smap.layers if lm.attn.flagged}
    assert attn == {1: [DEAD_V_ROW, DEAD_V_ROW + 16]}


def test_ablation_confirms_and_protected_layers_stay_out(built: Built) -> None:
    smap, _ = built
    assert smap.protected_layers == [NUM_LAYERS - 1]
    assert smap.ablation.accepted
    assert abs(smap.ablation.change_pct) < 1e-6
    silent = {lm.layer: lm.mlp.silent for lm in smap.layers if lm.mlp.silent}
    assert silent == {k: v for k, v in DEAD_MLP.items() if k != NUM_LAYERS - 1}
    assert smap.layers[NUM_LAYERS - 1].mlp.silent == []
    assert smap.layers[1].attn.silent == [DEAD_V_ROW, DEAD_V_ROW + 16]


def test_bias_like_channel_is_reported_not_silent(built: Built) -> None:
    smap, _ = built
    layer, channel = BIAS_CHANNEL
    assert smap.layers[layer].mlp.bias_like == [channel]
    assert channel not in smap.layers[layer].mlp.flagged
    assert all(not lm.attn.bias_like for lm in smap.layers)
    assert smap.layers[layer].mlp.std[channel] < 1e-3 < smap.layers[layer].mlp.signed_mean[channel]


def test_rejected_ablation_keeps_candidates_only(lm: LoadedModel, data: CalibrationData) -> None:
    # An impossible budget (a change below -1 %) rejects even a free ablation.
    smap, _ = build_map(lm, data, SilenceRule(protect_last=1, max_change_pct=-1.0))
    assert not smap.ablation.accepted
    assert all(not cs.silent for lm_ in smap.layers for cs in lm_.kinds().values())
    assert {row["layer"]: row["mlp"] for row in smap.ablation.candidates} == {
        0: DEAD_MLP[0],
        1: DEAD_MLP[1],
    }


def test_zeroing_a_live_channel_changes_the_output(lm: LoadedModel) -> None:
    ids = torch.tensor([lm.tokenizer("Sparse activations")["input_ids"]])
    with torch.inference_mode():
        dense = lm.model(input_ids=ids).logits
        with channels_zeroed(lm.layers, {(0, "mlp"): [10]}):
            ablated = lm.model(input_ids=ids).logits
        again = lm.model(input_ids=ids).logits
    assert not torch.allclose(dense, ablated)
    assert torch.equal(dense, again)  # the hooks are gone


def synthetic(mean: float, width: int = 4, positions: int = 100) -> ChannelStats:
    stats = ChannelStats.empty(width)
    rows = torch.full((positions, width), 1.0)
    rows[:, 0] = mean  # channel 0 is near-zero at |a| = mean
    stats.add(rows, SilenceRule())
    return stats


def test_critical_channels_use_a_ten_times_stricter_rule() -> None:
    quiet = synthetic(5e-5)  # under eps 1e-4, over the critical eps 1e-5
    assert flag_silent(quiet, SilenceRule()) == [0]
    assert flag_silent(quiet, SilenceRule(), critical=[0]) == []
    assert flag_silent(synthetic(5e-7), SilenceRule(), critical=[0]) == [0]


def test_json_round_trip_and_diff(built: Built, tmp_path: Path) -> None:
    smap, _ = built
    text = json.dumps(smap.to_dict())
    again = SilenceMap.from_dict(json.loads(text))
    assert again == smap
    data = json.loads(text)
    assert set(data["layers"][0]["mlp"]) >= {
        "size", "silent", "bias_like", "mean", "std", "near_zero_share", "signed_mean"
    }  # fmt: skip
    assert set(data["ablation"]) >= {"metric", "dense", "ablated", "change_pct", "accepted"}
    other = SilenceMap.from_dict(json.loads(text))
    other.corpus = "other"
    other.layers[0].mlp.silent = [3, 60]
    result = diff(smap, other)
    assert result["layers"] == [{"layer": 0, "kind": "mlp", "only_a": [50], "only_b": [60]}]


def png_dimensions(blob: bytes) -> tuple[int, int]:
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    length, tag = struct.unpack(">I4s", blob[8:16])
    assert tag == b"IHDR"
    header = blob[16 : 16 + length]
    assert (
        zlib.crc32(blob[12 : 16 + length]) & 0xFFFFFFFF
        == struct.unpack(">I", blob[16 + length : 20 + length])[0]
    )
    width, height = struct.unpack(">II", header[:8])
    return width, height


def test_png_is_a_valid_image_of_the_map(built: Built) -> None:
    smap, _ = built
    blob = render_png(smap)
    width, height = png_dimensions(blob)
    assert (width, height) == png_size(smap)
    assert width == 128 + 8 + 64 and height == NUM_LAYERS * 6
    idat = blob.index(b"IDAT")
    size = struct.unpack(">I", blob[idat - 4 : idat])[0]
    raw = zlib.decompress(blob[idat + 4 : idat + 4 + size])
    assert len(raw) == height * (1 + 3 * width)
    row0 = raw[1 : 1 + 3 * width]
    assert tuple(row0[3 * 3 : 3 * 3 + 3]) == (230, 20, 20)  # layer 0 channel 3: silent red


def test_html_is_self_contained_and_carries_the_data(built: Built) -> None:
    smap, series = built
    page = render_html(smap, series)
    assert "http://" not in page and "https://" not in page
    assert "data:image/png;base64," in page
    payload = page.split('<script id="data" type="application/json">', 1)[1]
    data = json.loads(payload.split("</script>", 1)[0])
    assert data["layers"][0]["mlp"]["silent"] == DEAD_MLP[0]
    assert data["series_samples"]["0:mlp"] == smap.samples
    assert len(data["series"]["0:mlp"]) == 4 * ((smap.samples * 128 + 2) // 3)


def test_read_critical(tmp_path: Path) -> None:
    path = tmp_path / "critical.txt"
    path.write_text("# layer kind channel\n3 mlp 17\n3 mlp 18  # tool use\n0 attn 2\n")
    assert read_critical(path) == {(3, "mlp"): [17, 18], (0, "attn"): [2]}
    path.write_text("3 ffn 17\n")
    with pytest.raises(ValueError, match="LAYER KIND CHANNEL"):
        read_critical(path)


def test_summary_and_diff_cli(
    built: Built,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    smap, _ = built
    text = summary(smap)
    assert "accepted" in text and "early" in text and "late" in text
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(smap.to_dict()))
    other = smap.to_dict()
    other["layers"][1]["attn"]["silent"] = []
    b.write_text(json.dumps(other))
    assert main(["silence-diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "layer   1 attn" in out and "[5,21]" in out


def test_silence_map_cli_writes_the_three_artefacts(
    lm: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir, corpus = tmp_path / "model", tmp_path / "corpus.txt"
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    corpus.write_text("\n\n".join(sample_texts(16)))
    out = tmp_path / "out"
    argv = ["silence-map", "--model", str(model_dir), "--data", str(corpus), "--samples", "8"]
    assert main([*argv, "--heldout-tokens", "256", "--protect-last", "1", "--out", str(out)]) == 0
    smap = SilenceMap.from_dict(json.loads((out / "silence-map.json").read_text()))
    assert smap.layers[0].mlp.silent == DEAD_MLP[0]
    assert png_dimensions((out / "silence-map.png").read_bytes()) == png_size(smap)
    assert (out / "silence-map.html").read_text().startswith("<!doctype html>")
    assert "ablation (perplexity)" in capsys.readouterr().out
