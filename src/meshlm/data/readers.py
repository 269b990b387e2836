"""Documents out of files: plain text, JSONL (also .gz / .zst) and Parquet, one at a time.

Reduces: holding a corpus in memory to read it; every reader streams, so memory is one document
(or one 8 MB segment of a large text file, or one Parquet batch). Costs: one pass of decoding.

A document is (name, text) with `\\r\\n` turned into `\\n` (the model never learns to emit `\\r`).
- text (.txt .md .text .rst): one file is one document; a file over `SEGMENT_BYTES` is cut at line
  starts into documents of about that size, so a 10 GB text file never sits in memory whole.
- JSONL (.jsonl, .jsonl.gz, .jsonl.zst): one JSON object per line, its `data.text_field` string.
- Parquet (.parquet): the `data.text_field` column, read one row group batch at a time.
Bad input is a ConfigError (exit 2) naming the file and the line, byte or column.

Libraries, and why: `gzip` (standard library); `zstandard` (the reference zstd bindings, streaming
decompression without reading the whole file); `pyarrow` (the reference Parquet implementation,
batch iteration over one column without loading the table). Both are imported only when a file
of that kind is read, so a text-only user never pays for them.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import Iterator

from meshlm.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
# Files taken from a directory: a suffix list rather than "every regular file", so that a
# repository checkout or a folder with images in it does not feed binaries in.
CORPUS_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
SEGMENT_BYTES = 4 << 20  # a text file larger than this is cut into documents of about this size
_PARQUET_BATCH_ROWS = 1024

Document = tuple[str, str]  # (name, text)


def file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def find_files(root: Path) -> list[Path]:
    """Every corpus file under `root`, recursively, in sorted relative-path order; hidden files
    and directories are skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath, f) for f in filenames
                  if not f.startswith(".") and f.lower().endswith(CORPUS_SUFFIXES)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def unreadable(path: Path, error: OSError) -> ConfigError:
    """The one-line error for a corpus file that cannot be opened (a dangling link, no permission)."""
    return ConfigError(f"data.path: {path}: cannot read ({error.strerror or error})")


def open_file(path: Path) -> io.BufferedReader:
    try:
        return open(path, "rb")
    except OSError as e:
        raise unreadable(path, e) from None


def read_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    """The non-blank documents of one file, in file order."""
    kind = file_kind(path)
    if kind == "jsonl":
        yield from _jsonl_documents(path, name, text_field)
    elif kind == "parquet":
        yield from _parquet_documents(path, name, text_field)
    else:
        yield from _text_documents(path, name)


def estimated_text_bytes(path: Path) -> int:
    """About how many bytes of text a file holds, without reading it (for progress and sampling):
    compressed JSONL counts 4x its size, a typical ratio for text."""
    size = path.stat().st_size
    return size * 4 if path.name.lower().endswith((".gz", ".zst", ".parquet")) else size


# --------------------------------------------------------------------------- text


def _normalise(text: str) -> str:
    return text.replace("\r\n", "\n")


def _text_documents(path: Path, name: str) -> Iterator[Document]:
    with open_file(path) as f:
        if os.fstat(f.fileno()).st_size <= SEGMENT_BYTES:
            text = _decode(f.read(), path, 0, first=True)
            if text.strip():
                yield name, text
            return
        offset, carry, index = 0, b"", 0
        while True:
            block = f.read(SEGMENT_BYTES)
            data = carry + block
            if not data:
                return
            cut = _segment_end(data) if block else len(data)
            segment, carry = data[:cut], data[cut:]
            text = _decode(segment, path, offset, first=offset == 0)
            offset += len(segment)
            if text.strip():
                yield f"{name}@{index}", text
                index += 1


def _segment_end(data: bytes) -> int:
    """Just after the last newline (so `\r\n` and multi-byte characters stay whole), else at the
    start of the last character (which may be incomplete: it goes to the next segment)."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    start = len(data) - 1
    while start > 0 and (data[start] & 0xC0) == 0x80:  # UTF-8 continuation bytes
        start -= 1
    return start or len(data)


def _decode(data: bytes, path: Path, offset: int, *, first: bool) -> str:
    try:
        # utf-8-sig drops a byte-order mark at the start of the file.
        return _normalise(data.decode("utf-8-sig" if first else "utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.path: {path} is not UTF-8 text ({e.reason} at byte {offset + e.start})") from None


# --------------------------------------------------------------------------- JSONL


def _decompressed(path: Path, file: io.BufferedReader) -> io.BufferedIOBase:
    """`file`'s bytes, decompressed as its name says."""
    lower = path.name.lower()
    if lower.endswith(".gz"):
        return gzip.GzipFile(fileobj=file, mode="rb")
    if lower.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(file))
    return file


_ZSTD_BLOCK = 1 << 16  # compressed bytes decompressed at a time: ~0.3 MB of text out


class _ZstdFrames(io.RawIOBase):
    """A .zst file's frames (one, or several as pzstd and `cat` make), decompressed one block at a
    time, so the file is never held whole. A file that ends inside a frame raises EOFError, as
    gzip does: zstandard's stream_reader ends its stream there without a word, and a truncated
    download would be read short with exit 0."""

    def __init__(self, file: io.BufferedReader):
        import zstandard

        self._new_frame = zstandard.ZstdDecompressor().decompressobj
        self._file = file
        self._frame = None  # the decompressor of the frame in progress; None between frames
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            block = self._file.read(_ZSTD_BLOCK)
            if not block:
                if self._frame is not None:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self._out, self._pos = self._decompress(block), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = memoryview(self._out)[self._pos:self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None:
                self._frame = self._new_frame()
            out.append(self._frame.decompress(data))
            if not self._frame.eof:
                break
            data, self._frame = self._frame.unused_data, None  # the next frame starts in this block
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _jsonl_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    line_no = 0
    file = open_file(path)  # before the try: a file that cannot be opened is not a decompression error
    try:
        with file, _decompressed(path, file) as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                text = _jsonl_text(raw, path, line_no, text_field)
                if text.strip():
                    yield f"{name}:{line_no}", _normalise(text)
    except ConfigError:
        raise
    except Exception as e:  # a truncated or corrupt .gz (OSError, EOFError) or .zst (zstandard.ZstdError)
        if not isinstance(e, (OSError, EOFError)) and type(e).__name__ != "ZstdError":
            raise
        raise ConfigError(f"data.path: {path}: cannot decompress after line {line_no} ({e})") from None


def _jsonl_text(raw: bytes, path: Path, line_no: int, text_field: str) -> str:
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.path: {path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"data.path: {path}:{line_no}: not JSON ({e.msg} at column {e.colno})") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = "no such field" if not isinstance(record, dict) or text_field not in record else \
            f"a {type(text).__name__}, not a string"
        raise ConfigError(f"data.path: {path}:{line_no}: field {text_field!r} (data.text_field): {found}")
    if b"\\u" in raw:  # only a \uXXXX escape can make a lone surrogate: the line's bytes are strict UTF-8
        _check_no_lone_surrogate(text, path, line_no, text_field)
    return text


def _check_no_lone_surrogate(text: str, path: Path, line_no: int, text_field: str) -> None:
    """An error for half a UTF-16 pair ("\\ud83d" alone), which json accepts but is not Unicode
    text: the tokenizer (Rust strings) cannot take it, and replacing it with U+FFFD would train on
    a character the writer never meant. An error, as for invalid UTF-8 bytes in a line: the same
    defect (a string cut inside a character), and the writer's bug to fix."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"data.path: {path}:{line_no}: field {text_field!r} (data.text_field) holds a lone "
                          f"surrogate \\u{ord(text[e.start]):04x} at character {e.start} (half a UTF-16 pair: "
                          f"not Unicode text)") from None


# --------------------------------------------------------------------------- Parquet


def _parquet_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    open_file(path).close()  # a file that cannot be opened is not "not a Parquet file"
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"data.path: {path}: not a Parquet file ({e})") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise ConfigError(f"data.path: {path}: no column {text_field!r} (data.text_field; columns: "
                          f"{', '.join(schema.names) or 'none'})")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ConfigError(f"data.path: {path}: column {text_field!r} (data.text_field) holds {column_type}, not strings")
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None and text.strip():
                yield f"{name}#{row}", _normalise(text)
            row += 1
