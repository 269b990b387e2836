"""The on-disk side of checkpoints: atomic directories, manifests with checksums, discovery,
rotation, and a reader that serves any rectangle of any stored tensor.

    run.dir/checkpoints/step_0000100/
        rank00000.safetensors ...   each rank's rectangles (model, exp_avg, exp_avg_sq) and RNG
                                    states; its index of rectangles sits in the file's header
        meta.json                   step, data position, layout, config, shapes, version
        config.toml, tokenizer.json the resolved config and the tokenizer (self-contained)
        manifest.json               written last: size and sha256 of every other file

A checkpoint is written into `.tmp_step_0000100/`, every file fsynced, the manifest written
last, then the directory renamed: a crash at any point leaves either the previous checkpoints
untouched or a `.tmp_*` directory that nothing ever loads. Nothing is unpickled: tensors are
safetensors, everything else JSON or TOML.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from meshlm.durable import fsync_dir
from meshlm.errors import RunError, naming
from meshlm.train.checkpoint.pieces import Rect

MANIFEST = "manifest.json"
META = "meta.json"
FORMAT = "meshlm-checkpoint"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{7,})$")


class CheckpointError(RunError):
    """A checkpoint that cannot be used (missing, incomplete, corrupt); one line."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_bytes_synced(path: Path, data: bytes) -> dict:
    """Write `data` to `path`, fsync it, and return its manifest entry (size and sha256)."""
    with naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      fetch: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Stream a safetensors file: the header (every tensor's dtype, shape and offsets, known from
    `layout` up front), then each tensor as `fetch(name)` returns it (CPU), hashing the bytes as
    they are written; fsync it, and return its manifest entry {bytes, sha256}.

    Hand-written (the format is an 8-byte header length, a JSON header, the raw bytes) because
    safetensors' own writers need every tensor in memory at once, build the file as one `bytes`
    object (a second copy of a rank's shard: 4.7 s for 1.2 GB here), and cannot hash on the way
    (a second pass over the file). Checkpoints and exports are read back with safetensors itself."""
    header, offset = {}, 0
    for name, (dtype, shape) in layout.items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    with naming(path), open(path, "wb") as f:
        for block in (len(head).to_bytes(8, "little"), head):
            f.write(block)
            digest.update(block)
        for name, (dtype, shape) in layout.items():
            t = fetch(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, the header says {dtype} {tuple(shape)}")
            raw = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
            f.write(raw)
            digest.update(raw)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": 8 + len(head) + offset, "sha256": digest.hexdigest()}


def write_tensors_synced(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """`write_safetensors` of tensors already in hand (a rank's checkpoint file)."""
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    return write_safetensors(path, layout, tensors.__getitem__, metadata)


# --------------------------------------------------------------------------- finishing a save


def finalize(tmp: Path, final: Path, entries: dict[str, dict], step: int) -> None:
    """Write the manifest (last), then rename the temporary directory into place. `entries`:
    file name -> {bytes, sha256} for every file the ranks wrote."""
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "files": dict(sorted(entries.items()))}
    write_bytes_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it whole
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def rotate(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (and stale temporary directories)."""
    removed = []
    for path in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def clear_stale_temporaries(root: Path) -> None:
    """`.tmp_*` directories are saves that never finished (a crash mid-write): never loadable."""
    if root.is_dir():
        for path in root.glob(".tmp_step_*"):
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- finding and checking


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under `root`, oldest first (by step), complete or not."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path`; CheckpointError if it is not one."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (not a checkpoint, or its save never finished)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/{MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path}/{MANIFEST}: not a meshlm checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')} "
                              f"(this meshlm reads {FORMAT_VERSION})")
    return manifest


def read_meta(path: Path) -> dict:
    read_manifest(path)
    return json.loads((path / META).read_text())


def verify_files(path: Path, names: list[str], manifest: dict) -> str | None:
    """None if every file in `names` exists with the size and sha256 the manifest gives, else a
    one-line reason naming the first file that does not."""
    for name in names:
        expected = manifest["files"][name]
        file = path / name
        if not file.is_file():
            return f"{file}: missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{file}: {size} bytes, the manifest says {expected['bytes']}"
        if sha256_file(file) != expected["sha256"]:
            return f"{file}: contents do not match the manifest's checksum"
    return None


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """Check checkpoint `path`: None if good, else a one-line reason. `share=(i, n)` checks only
    every n-th file from the i-th, so n ranks can hash a large checkpoint in parallel."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    names = sorted(manifest["files"])
    if META not in manifest["files"]:
        return f"{path}/{MANIFEST}: lists no {META}"
    return verify_files(path, names[share[0]:: share[1]], manifest)


# --------------------------------------------------------------------------- reading


class CheckpointReader:
    """Any rectangle of any stored tensor, assembled from the rank files that hold pieces of it.

    The index comes from the rank files' headers (safetensors metadata), so opening a checkpoint
    reads no tensor data; each read fetches only the overlapping slices (safetensors slices
    lazily from the memory-mapped file)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._files: dict[str, object] = {}
        self.index: dict[tuple[str, str], list[tuple[str, str, Rect]]] = {}
        try:
            self.meta = json.loads((self.path / META).read_text())
            self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v) for k, v in self.meta["shapes"].items()}
            for name in sorted(self.manifest["files"]):
                if not name.endswith(".safetensors"):
                    continue
                header = self._open(name).metadata() or {}
                for key, kind, tensor, row, col, rows, cols in json.loads(header.get("pieces", "[]")):
                    self.index.setdefault((kind, tensor), []).append((name, key, Rect(row, col, rows, cols)))
        except Exception as e:  # noqa: BLE001 - OSError, JSON, KeyError, safetensors' own header errors
            raise CheckpointError(f"{self.path}: unreadable ({type(e).__name__}: {e})") from None

    def _open(self, name: str):
        if name not in self._files:
            self._files[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
        return self._files[name]

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.index

    def read(self, kind: str, name: str, rect: Rect, out: torch.Tensor) -> None:
        """Fill `out` (a [rect.rows, rect.cols] view, any dtype) with that rectangle of tensor
        `name`; CheckpointError if the checkpoint does not cover all of it."""
        covered = 0
        for file, key, stored in self.index.get((kind, name), ()):
            part = rect.intersect(stored)
            if part is None:
                continue
            src = self._open(file).get_slice(key)[part.row - stored.row: part.row - stored.row + part.rows,
                                                  part.col - stored.col: part.col - stored.col + part.cols]
            out[part.row - rect.row: part.row - rect.row + part.rows,
                part.col - rect.col: part.col - rect.col + part.cols].copy_(src)
            covered += part.numel
        if covered != rect.numel:
            raise CheckpointError(f"{self.path}: {kind} of {name} rows {rect.row}..{rect.row + rect.rows} "
                                  f"cols {rect.col}..{rect.col + rect.cols}: {covered} of {rect.numel} elements stored")

    def full(self, kind: str, name: str) -> torch.Tensor:
        """The whole tensor (fp32, its own shape): for export and tests, not for training ranks."""
        shape = self.shapes[name]
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        out = torch.empty(rows, cols, dtype=torch.float32)
        self.read(kind, name, Rect(0, 0, rows, cols), out)
        return out.view(shape)

    def rank_tensor(self, rank: int, key: str) -> torch.Tensor | None:
        """A per-rank tensor (e.g. an RNG state) from rank `rank`'s file, if it has one."""
        name = rank_file(rank)
        if name not in self.manifest["files"]:
            return None
        f = self._open(name)
        return f.get_tensor(key) if key in f.keys() else None


def newest_good(root: Path, check: Callable[[Path], str | None], warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under `root` that passes `check`, warning about each newer one that
    does not. None if there is none at all; CheckpointError if some exist and none is good."""
    candidates = list_checkpoints(root)
    problems = []
    for path in reversed(candidates):
        problem = check(path)
        if problem is None:
            return path
        problems.append(problem)
        warn(f"skipping checkpoint {path.name}: {problem}")
    if candidates:
        raise CheckpointError(f"no usable checkpoint in {root}: {problems[0]}")
    return None
