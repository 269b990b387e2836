"""Encoded chunks -> shard files on disk, each marked complete last; then one memmap per split.

Reduces: lost work and memory. A killed preparation resumes after the last complete shard, and
nothing but the open shard's buffers is ever in memory. Costs: one extra sequential copy of the
tokens at the end (the merge: ~1 s per GB of tokens), and twice the tokens' disk space meanwhile.

Layout while building (`<cache>/.building-<name>/shards/`): shard k is `k.train.bin`, `k.val.bin`
(raw ids), `k.lengths.npz` (tokens per document) and `k.json` (counts, written last by an atomic
rename: it marks the shard complete). A shard holds a fixed number of consecutive chunks, so the
chunks a complete shard covers are known, and resuming skips them without encoding them again.

The finished cache holds one file per split (`train.bin`, `val.bin`: every rank memory-maps one
flat stream) and its document index (`train.idx.npy`, `val.idx.npy`: int64 offsets, document d
is tokens[idx[d]:idx[d+1]], as Megatron's .idx files).
"""

from __future__ import annotations

import heapq
import json
import os
import shutil
from pathlib import Path

import numpy as np

from meshlm.data.encode import EncodedChunk
from meshlm.durable import replace_durably

SHARD_CHUNKS = 64  # ~64 MB of text per shard: the most a kill can cost
LONGEST_KEPT = 5  # the longest documents remembered, for meshlm data inspect
SPLITS = ("train", "val")


def write_json_atomically(path: Path, value: dict) -> None:
    """`path` holds `value` whole, or the old content, after a crash or power loss at any point:
    the temporary file's data is on disk before its rename, and the rename before we return. A
    rename alone can reach the disk before the data (ext4, XFS): the name would then hold an
    empty or partial file, read back as an unparsable marker."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    replace_durably(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or torn (not whole JSON:
    a crash of an older writer, a disk error). None means "not written": the caller rebuilds."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class ShardWriter:
    """Append encoded chunks; every `shard_chunks` chunks the open shard is closed and marked."""

    def __init__(self, directory: Path, shard_chunks: int = SHARD_CHUNKS):
        self.directory = directory
        self.shard_chunks = shard_chunks
        self.done: list[dict] = []  # the json of every complete shard, in order
        self._open: dict | None = None

    @property
    def done_chunks(self) -> int:
        return sum(shard["chunks"] for shard in self.done)

    def resume(self) -> int:
        """Keep the complete shards 0..k-1 (k returned) and delete everything after them."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.done = []
        # A marker that does not parse is an incomplete shard: it and everything after are redone.
        while (summary := read_json(self.directory / f"{len(self.done):05d}.json")) is not None:
            self.done.append(summary)
        for path in self.directory.iterdir():
            if path.name[:5].isdigit() and int(path.name[:5]) >= len(self.done):
                path.unlink()
            elif path.name.startswith("."):  # a marker's temporary file
                path.unlink()
        return len(self.done)

    def add(self, chunk: EncodedChunk, names: list[str]) -> None:
        if self._open is None:
            index = len(self.done)
            self._open = {"index": index, "chunks": 0, "documents": 0, "text_bytes": 0, "longest": [],
                          "files": {s: open(self.directory / f"{index:05d}.{s}.bin", "wb") for s in SPLITS},
                          "lengths": {s: [] for s in SPLITS}}
        shard = self._open
        for split in SPLITS:
            shard["files"][split].write(getattr(chunk, split).tobytes())
            shard["lengths"][split].append(getattr(chunk, f"{split}_lengths"))
        shard["chunks"] += 1
        shard["documents"] += len(names)
        shard["text_bytes"] += chunk.text_bytes
        # The train heads' lengths, named (a document held out whole has no head).
        sizes, index = chunk.train_lengths, chunk.train_index
        top = np.argsort(sizes)[-LONGEST_KEPT:]
        shard["longest"] = heapq.nlargest(LONGEST_KEPT, shard["longest"] + [[int(sizes[i]), names[int(index[i])]]
                                                                            for i in top])
        if shard["chunks"] == self.shard_chunks:
            self.close_shard()

    def close_shard(self) -> None:
        shard, self._open = self._open, None
        if shard is None:
            return
        index = shard["index"]
        lengths = {s: np.concatenate(shard["lengths"][s]) for s in SPLITS}
        for split in SPLITS:
            shard["files"][split].flush()
            os.fsync(shard["files"][split].fileno())  # the marker must never precede the data
            shard["files"][split].close()
        with open(self.directory / f"{index:05d}.lengths.npz", "wb") as f:
            np.savez(f, **lengths)
            f.flush()
            os.fsync(f.fileno())
        summary = {"chunks": shard["chunks"], "documents": shard["documents"], "text_bytes": shard["text_bytes"],
                   "longest": shard["longest"], **{f"{s}_tokens": int(lengths[s].sum()) for s in SPLITS},
                   **{f"{s}_documents": int(len(lengths[s])) for s in SPLITS}}
        write_json_atomically(self.directory / f"{index:05d}.json", summary)
        self.done.append(summary)

    def merge(self, out: Path, dtype: np.dtype) -> dict:
        """Concatenate the complete shards into `out/{split}.bin` and `{split}.idx.npy`; return totals."""
        self.close_shard()
        n = len(self.done)
        for split in SPLITS:
            tmp = out / f".{split}.bin.tmp"
            with open(tmp, "wb") as dst:
                for k in range(n):
                    with open(self.directory / f"{k:05d}.{split}.bin", "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, out / f"{split}.bin")
            self._write_index(out / f"{split}.idx.npy", split)
        totals = {key: sum(shard[key] for shard in self.done)
                  for key in ("documents", "text_bytes", "train_tokens", "val_tokens", "train_documents",
                              "val_documents")}
        totals["longest"] = heapq.nlargest(LONGEST_KEPT, [d for shard in self.done for d in shard["longest"]])
        totals["shards"] = n
        expected = totals["train_tokens"] * dtype.itemsize
        if (out / "train.bin").stat().st_size != expected:  # a shard file shorter than its marker says
            raise RuntimeError(f"{out}/train.bin has {(out / 'train.bin').stat().st_size} bytes, expected {expected}")
        return totals

    def _write_index(self, path: Path, split: str) -> None:
        """offsets[0] = 0, offsets[d+1] = offsets[d] + tokens of document d: a .npy written shard by
        shard, so memory is one shard's lengths whatever the number of documents. Streamed with
        plain writes, not through a memmap, whose dirty pages would count in this process's
        resident memory until written back (one int64 per document: ~0.1 byte per byte of text)."""
        count = sum(shard[f"{split}_documents"] for shard in self.done)
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(np.int64).str, "fortran_order": False,
                                                     "shape": (count + 1,)})
            end = 0
            f.write(np.zeros(1, dtype=np.int64).tobytes())
            for k in range(len(self.done)):
                lengths = np.load(self.directory / f"{k:05d}.lengths.npz")[split]
                offsets = end + np.cumsum(lengths, dtype=np.int64)
                f.write(offsets.tobytes())
                end = int(offsets[-1]) if len(offsets) else end
            f.flush()
            os.fsync(f.fileno())  # on disk before meta.json says the cache is complete

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
