"""Compression plans on tiny Llamas with planted dead and constant FFN channels: A runtime
masking, B structural pruning (and loading it back), C 2:4 masks; plus the CLI end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.cli import main
from sparse_engine.compression.prune import (
    intermediate_sizes,
    num_parameters,
    prune,
    pruned_copy,
    verify,
)
from sparse_engine.compression.semi24 import (
    compliance,
    compliance_table,
    input_norms,
    semi24_copy,
    two_four_mask,
)
from sparse_engine.model.arch import LayerParts
from sparse_engine.model.loader import LoadedModel, load_model, wrap
from sparse_engine.runtime.engine import GenerationRequest
from sparse_engine.sparsity.masking import (
    ChannelMask,
    masked,
    parse_layer_list,
    read_bias_like,
    read_silent_channels,
)
from sparse_engine.sparsity.plan import Level
from tests.tiny import byte_tokenizer, tiny_engine, tiny_model

DEAD = {0: [1, 5, 9, 100], 1: [2, 3, 4, 50, 77, 127]}  # per-layer sizes will differ
PROMPTS = ["The quick brown fox", "Sparse activations skip work", "Document 3. Held-out"]


def plant_dead(lm: LoadedModel, dead: dict[int, list[int]] = DEAD) -> LoadedModel:
    """Zero the gate and up rows of the chosen channels: their activation is exactly 0."""
    with torch.no_grad():
        for part in lm.layers:
            for channel in dead.get(part.index, []):
                linear(part, "gate").weight[channel] = 0.0
                linear(part, "up").weight[channel] = 0.0
    return lm


def linear(part: LayerParts, role: str) -> torch.nn.Linear:
    module = part.get(role)
    assert isinstance(module, torch.nn.Linear)
    return module


def logits(lm: LoadedModel, text: str = PROMPTS[0]) -> torch.Tensor:
    ids = torch.tensor([lm.tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out: torch.Tensor = lm.model(input_ids=ids).logits[0]
    return out


def dead_mask() -> ChannelMask:
    return ChannelMask({k: tuple(v) for k, v in DEAD.items()})


# --- plan A: masking -----------------------------------------------------------------------


FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_planted_dead_channels_changes_nothing_and_hooks_are_removed(family: str) -> None:
    lm = plant_dead(tiny_model(family))
    dense = logits(lm)
    with masked(lm.layers, dead_mask()):
        assert torch.equal(logits(lm), dense)
    live = ChannelMask({0: (0, 7, 8)})
    with masked(lm.layers, live):
        assert not torch.equal(logits(lm), dense)
    assert torch.equal(logits(lm), dense)  # hooks gone on exit


def test_masking_listed_layer_equals_a_model_with_that_mlp_zeroed() -> None:
    lm = tiny_model()
    reference = copy.deepcopy(lm.model)
    with torch.no_grad():
        reference.model.layers[1].mlp.down_proj.weight.zero_()
    expected = logits(wrap(reference, lm.tokenizer, "ref", "ref"))
    with masked(lm.layers, ChannelMask(layers=(1,))):
        got = logits(lm)
    assert not torch.equal(got, logits(lm))
    assert torch.allclose(got, expected, atol=1e-6)


def test_mask_rejects_layers_and_channels_outside_the_model() -> None:
    lm = tiny_model()
    with (
        pytest.raises(ValueError, match=r"layers 0\.\.1"),
        masked(lm.layers, ChannelMask(layers=(5,))),
    ):
        pass
    with pytest.raises(ValueError, match="whose MLP has 128"):
        ChannelMask({0: (128,)}).check_fits(lm.layers)
    assert parse_layer_list("9, 7,8") == (7, 8, 9) and parse_layer_list(None) == ()
    with pytest.raises(ValueError, match="comma-separated"):
        parse_layer_list("7-9")


def test_engine_masks_alongside_sparsity_plans() -> None:
    eng = tiny_engine(cache=False)
    plant_dead(eng.lm)
    request = GenerationRequest(prompt=PROMPTS[1], max_new_tokens=8, ignore_eos=True)
    plain = {lv: eng.generate(request, lv).result() for lv in (Level.DENSE, Level.BALANCED)}
    eng.set_mask(dead_mask())
    for level, before in plain.items():
        after = eng.generate(request, level).result()
        assert after.token_ids == before.token_ids
        assert after.signals is not None and before.signals is not None
    eng.set_mask(ChannelMask(layers=(0, 1)))
    skipped = eng.generate(request, Level.DENSE).result()
    assert skipped.token_ids != plain[Level.DENSE].token_ids
    eng.set_mask(None)
    assert eng.generate(request, Level.DENSE).result().token_ids == plain[Level.DENSE].token_ids


def test_engine_keys_prefix_cache_entries_by_mask() -> None:
    eng = tiny_engine(cache=True)
    request = GenerationRequest(prompt=PROMPTS[2] * 4, max_new_tokens=2)
    eng.generate(request).result()
    eng.set_mask(ChannelMask(layers=(1,)))
    assert eng.generate(request).result().cached_tokens == 0


# --- plan B: pruning -----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_dead_channels_is_exact_smaller_and_loads_back(tmp_path: Path, family: str) -> None:
    lm = plant_dead(tiny_model(family))
    saved, result = prune(lm, DEAD, tmp_path / "pruned")
    assert result.intermediate_sizes == [124, 122]
    assert result.params_after < result.params_before == num_parameters(lm.model)
    back = load_model(tmp_path / "pruned")
    assert intermediate_sizes(back.layers) == [124, 122]
    assert num_parameters(back.model) == result.params_after
    assert back.weights_sha256 == saved.weights_sha256 != lm.weights_sha256
    for text in PROMPTS:
        assert torch.allclose(logits(back, text), logits(lm, text), atol=1e-5)
    check = verify(back, lm, dead_mask(), PROMPTS, max_new_tokens=8, tolerance=1e-5)
    assert check.passed and check.tokens_equal and check.max_abs_logit_diff <= 1e-5


def test_masking_and_pruning_agree_on_live_channels() -> None:
    lm = tiny_model()  # nothing planted: removing live channels changes the model
    live = {0: [0, 3], 1: [10, 11, 12]}
    mask = ChannelMask({k: tuple(v) for k, v in live.items()})
    pruned = pruned_copy(lm, live)
    with masked(lm.layers, mask):
        expected = logits(lm)
    assert not torch.allclose(expected, logits(lm), atol=1e-4)
    assert torch.allclose(logits(pruned), expected, atol=1e-5)
    assert verify(pruned, lm, mask, PROMPTS, 6, 1e-5).passed
    assert not verify(pruned, lm, ChannelMask(), PROMPTS, 6, 1e-5).passed


def constant_channel_model() -> tuple[LoadedModel, dict[int, list[tuple[int, float]]]]:
    """A Llama with MLP biases whose channel 7 (layer 0) and 40 (layer 1) are constant:
    zero gate/up rows, so the activation is silu(b_gate) * b_up whatever the input."""
    torch.manual_seed(1)
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mlp_bias=True,
    )
    lm = wrap(LlamaForCausalLM(config), tok, "tiny-bias", "tiny-bias-1")
    constants: dict[int, list[tuple[int, float]]] = {}
    with torch.no_grad():
        for part, channel in zip(lm.layers, (7, 40), strict=True):
            gate, up = linear(part, "gate"), linear(part, "up")
            gate.weight[channel], up.weight[channel] = 0.0, 0.0
            gate.bias[channel], up.bias[channel] = 2.0, 3.0
            value = float(torch.nn.functional.silu(torch.tensor(2.0)) * 3.0)
            constants[part.index] = [(channel, value)]
    return lm, constants


def test_folding_a_constant_channel_into_a_bias_keeps_the_output() -> None:
    lm, constants = constant_channel_model()
    folded = pruned_copy(lm, {}, constants)
    assert intermediate_sizes(folded.layers) == [127, 127]
    for text in PROMPTS:
        assert torch.allclose(logits(folded, text), logits(lm, text), atol=1e-5)
    removed = pruned_copy(lm, {k: [c for c, _ in v] for k, v in constants.items()})
    assert not torch.allclose(logits(removed), logits(lm), atol=1e-3)


def test_folding_creates_a_down_bias_that_survives_saving(tmp_path: Path) -> None:
    lm = plant_dead(tiny_model())  # no MLP biases at all
    held = {1: [(20, 0.5), (21, -1.25)]}
    mask = ChannelMask(dead_mask().channels, constants={1: tuple(held[1])})
    with masked(lm.layers, mask):
        expected = logits(lm)
    _, result = prune(lm, DEAD, tmp_path / "folded", held)
    back = load_model(tmp_path / "folded")
    assert linear(back.layers[0], "down").bias is None
    assert linear(back.layers[1], "down").bias is not None
    assert result.intermediate_sizes == [124, 120]
    assert torch.allclose(logits(back), expected, atol=1e-5)
    assert verify(back, lm, mask, PROMPTS, 6, 1e-5).passed


def test_pruning_a_whole_mlp_equals_masking_the_layer(tmp_path: Path) -> None:
    lm = tiny_model()
    prune(lm, {1: list(range(128))}, tmp_path / "nolayer")
    back = load_model(tmp_path / "nolayer")
    assert intermediate_sizes(back.layers) == [128, 1]  # one all-zero channel stays
    assert verify(back, lm, ChannelMask(layers=(1,)), PROMPTS, 6, 1e-5).passed


# --- plan C: 2:4 ---------------------------------------------------------------------------


def test_two_four_mask_keeps_the_two_largest_of_each_group() -> None:
    weight = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 2.0, -1.5, 0.0]])
    assert two_four_mask(weight).tolist() == [[False, True, True, False, False, True, True, False]]
    scaled = two_four_mask(weight, torch.tensor([100.0, 1, 1, 1, 1, 1, 1, 1]))
    assert scaled[0, :4].tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="divisible by 4"):
        two_four_mask(torch.ones(2, 6))


@pytest.mark.parametrize("family", FAMILIES)
def test_semi24_copy_is_fully_compliant_and_leaves_the_original(family: str) -> None:
    lm = tiny_model(family)
    roles = ("down", "up", "gate")
    before = compliance_table(lm.layers, roles)
    assert all(0.0 <= c.share < 1.0 for c in before)
    batches = [torch.tensor([lm.tokenizer(t)["input_ids"]]) for t in PROMPTS]
    for norms in (None, input_norms(lm, batches, roles)):
        sparse = semi24_copy(lm, roles, norms)
        for part in sparse.layers:
            for role in roles:
                weight = linear(part, role).weight
                zeros = (weight.reshape(weight.shape[0], -1, 4) == 0).sum(-1)
                assert torch.all(zeros == 2)
                assert compliance(weight) == 1.0
    assert compliance_table(lm.layers, roles) == before


# --- CLI -----------------------------------------------------------------------------------


def write_map(path: Path, dead: dict[int, list[int]], bias_like: dict[int, list[int]]) -> Path:
    layers = []
    for layer in range(2):
        signed = [0.0] * 128
        for c in bias_like.get(layer, []):
            signed[c] = 0.25
        mlp = {"size": 128, "silent": dead.get(layer, []), "bias_like": bias_like.get(layer, [])}
        layers.append({"layer": layer, "mlp": mlp | {"signed_mean": signed}, "attn": {}})
    data = {"model_id": "tiny", "protected_layers": [], "layers": layers, "ablation": {}}
    path.write_text(json.dumps(data))
    return path


def test_silence_map_readers_skip_protected_layers_and_split_bias_like(tmp_path: Path) -> None:
    path = write_map(tmp_path / "map.json", {0: [3, 1], 1: [5, 6]}, {1: [6, 9]})
    assert read_silent_channels(path) == {0: [1, 3], 1: [5]}
    assert read_bias_like(path) == {1: [(6, 0.25), (9, 0.25)]}
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"protected_layers": [1]}))
    assert read_silent_channels(path) == {0: [1, 3]} and read_bias_like(path) == {}
    with pytest.raises(FileNotFoundError, match="silence-map"):
        read_silent_channels(tmp_path / "none.json")


def test_prune_cli_writes_a_verified_smaller_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    lm = plant_dead(tiny_model())
    lm.model.save_pretrained(tmp_path / "tiny")
    lm.tokenizer.save_pretrained(tmp_path / "tiny")
    smap = write_map(tmp_path / "map.json", DEAD, {})
    args = ["prune", "--model", str(tmp_path / "tiny"), "--silence-map", str(smap)]
    assert main([*args, "--out", str(tmp_path / "out"), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "verification against plan A PASSED" in out and "[124, 122]" in out
    assert intermediate_sizes(load_model(tmp_path / "out").layers) == [124, 122]
    missing = ["prune", "--silence-map", str(tmp_path / "no.json"), "--out", str(tmp_path / "x")]
    assert main([*missing, "--model", str(tmp_path / "tiny")]) == 2
    assert "run `sparseguard silence-map" in capsys.readouterr().err
