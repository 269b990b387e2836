"""What names a token cache (a content digest, a key) and who may build it (a file lock).

Reduces: re-tokenizing what is already prepared, and two processes (ranks, nodes, a second
`meshlm data prepare`) building the same cache at once. Costs: one read of the corpus files to
hash them when their (path, size, mtime) changed; a lock file beside the cache while it is built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from meshlm.data.readers import open_file
from meshlm.train.corpus import Corpus

_HASH_BLOCK = 1 << 20  # bounded memory: the block is all that is held


def content_digest(corpus: Corpus, index_dir: Path) -> str:
    """The sha256 of a corpus's files (names, sizes and bytes, in order), looked up by the
    corpus's (path, size, mtime) identity when it was computed before, as `make` decides.
    Raw bytes rather than decoded text: hashing runs at disk speed, before anything is parsed."""
    if corpus.identity_is_content:
        return corpus.identity
    index_file = index_dir / corpus.identity
    if index_file.is_file():
        return index_file.read_text().strip()
    hasher = hashlib.sha256()
    for name, path in corpus.files:
        with open_file(path) as f:  # a file gone or unreadable since it was listed: one line naming it
            hasher.update(f"{len(name)}:{name}:{os.fstat(f.fileno()).st_size}:".encode())
            while block := f.read(_HASH_BLOCK):
                hasher.update(block)
    digest = hasher.hexdigest()
    index_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=index_dir, prefix=".tmp-", delete=False) as f:
        f.write(digest + "\n")
    os.replace(f.name, index_file)
    return digest


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def is_complete(cache_dir: Path) -> bool:
    """meta.json is written last inside the building directory, which is then renamed into place:
    a directory with it is complete, and no other directory is ever read as a cache. A meta.json
    that does not parse (torn by a crash) is not complete: the cache is built again."""
    from meshlm.data.shards import read_json

    return read_json(cache_dir / "meta.json") is not None


@contextlib.contextmanager
def build_lock(cache_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock of `cache_dir`'s build; a second builder waits here, then finds the
    cache complete. flock: released by the kernel when the holder dies, so a killed build never
    leaves the lock held. The lock file is removed after the build; a waiter still holding the
    old file's lock then sees the finished cache, so the usual unlink race is harmless here."""
    lock_path = cache_dir.parent / f".{cache_dir.name}.lock"
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if is_complete(cache_dir):
                lock_path.unlink(missing_ok=True)
            fcntl.flock(f, fcntl.LOCK_UN)
