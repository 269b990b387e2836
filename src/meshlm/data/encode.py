"""Documents -> token ids on `data.workers` processes, chunk by chunk, results in corpus order.

Reduces: encoding time (one process per core) and memory (a bounded number of ~1 MB chunks in flight).
Costs: pickling each chunk's text to a worker and its ids back (a few % of the encoding time).

A chunk is consecutive documents of at least `CHUNK_BYTES` of text. Every document is encoded on
its own, so which chunk or which worker encodes it changes nothing: the output is identical for
any number of workers and any chunk size. Each worker encodes single-threaded (tokenizers'
own thread pool is off in workers): N processes on N cores, not N x N threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

CHUNK_BYTES = 1 << 20
_BATCH_CHARS = 256 << 10  # text per call of the tokenizer inside a worker
_LONG_DOCUMENT_CHARS = 128 << 10
_IN_FLIGHT_PER_WORKER = 2  # queued chunks per worker: enough to keep it busy, few enough to bound memory


# A document whose held-out tail would be shorter than this goes whole to one split instead: a
# tail of a few characters is a fragment of ~2 tokens and an EOT, which measures nothing, and
# cutting every short document would hold out a word of each (several times val_fraction).
_MIN_TAIL_CHARS = 128
_MAX_STEP_BACK = 4  # the cut moves back at most a quarter of the tail: at most 1.25 x val_fraction


def split_document(text: str, val_fraction: float) -> tuple[str, str]:
    """(train head, validation tail), one of them possibly empty; they share no text.

    A document long enough to have a tail of `_MIN_TAIL_CHARS` is cut near `val_fraction` from its
    end: back to a line start if one is within a quarter of the tail, else before a space, else
    (no space either: CJK, minified code) at the target. So validation covers every long
    document, never starts mid-word, and holds out 1 to 1.25 x val_fraction of it. A shorter
    document goes whole to validation with probability val_fraction, decided by a hash of its
    text (deterministic, and exact duplicates land in the same split), so the held-out share of
    a corpus of short documents is still about val_fraction.
    """
    n_tail = math.ceil(len(text) * val_fraction)
    if n_tail < _MIN_TAIL_CHARS:
        return ("", text) if _held_out_whole(text, val_fraction) else (text, "")
    target = len(text) - n_tail
    reach = target - n_tail // _MAX_STEP_BACK
    cut = text.rfind("\n", reach, target) + 1
    if cut == 0:
        cut = text.rfind(" ", reach, target + 1)  # the tail starts with " word", as in running text
    if cut <= 0:
        cut = target
    return text[:cut], text[cut:]


def _held_out_whole(text: str, val_fraction: float) -> bool:
    """Whether a document too short to cut is validation: a uniform draw from its text's hash."""
    digest = hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


@dataclass(frozen=True)
class EncodeSpec:
    """What every worker needs to encode a chunk (picklable: the tokenizer travels as JSON)."""

    tokenizer_json: str
    eot: int
    dtype: str
    vocab_size: int
    val_fraction: float
    split_pieces: bool  # cut long texts at pre-token boundaries first (tokenizer.splits_like_gpt2)


@dataclass
class EncodedChunk:
    """The ids of one chunk: every document's train head and validation tail, each + EOT."""

    train: np.ndarray
    val: np.ndarray
    train_lengths: np.ndarray  # tokens per document in `train` (EOT included), int64
    val_lengths: np.ndarray
    text_bytes: int
    worker_peak_bytes: int  # the encoding process's peak resident memory so far (getrusage)
    train_index: np.ndarray  # which of the chunk's documents are in `train` (a head), in order


def chunk_documents(documents: Iterable[tuple[str, str]], chunk_bytes: int = CHUNK_BYTES
                    ) -> Iterator[tuple[list[str], list[str], int]]:
    """(names, texts, text bytes) of consecutive documents, at least `chunk_bytes` per chunk."""
    names, texts, size = [], [], 0
    for name, text in documents:
        names.append(name)
        texts.append(text)
        size += len(text.encode())
        if size >= chunk_bytes:
            yield names, texts, size
            names, texts, size = [], [], 0
    if texts:
        yield names, texts, size


# --------------------------------------------------------------------------- in a worker

_WORKER: dict = {}


def _init_worker(spec: EncodeSpec) -> None:
    from tokenizers import Tokenizer

    from meshlm.train.tokenizer import for_documents

    tokenizer = for_documents(Tokenizer.from_str(spec.tokenizer_json))  # no truncation, no padding
    # A literal "<|endoftext|>" inside a text is ordinary characters: only our separators mean
    # "new document" (as train/tokenizer.encode_documents does).
    tokenizer.encode_special_tokens = True
    _WORKER.update(spec=spec, tokenizer=tokenizer)


def encode_chunk(texts: list[str]) -> EncodedChunk:
    """Encode one chunk in this process (a worker's job; callable directly after _init_worker)."""
    spec = _WORKER["spec"]
    dtype = np.dtype(spec.dtype)
    eot = np.array([spec.eot], dtype=dtype)
    heads_tails = [split_document(text, spec.val_fraction) for text in texts]
    out = {}
    for split, column in (("train", 0), ("val", 1)):
        parts = [pair[column] for pair in heads_tails if pair[column]]  # an empty head adds nothing
        arrays, lengths = [], []
        for doc_ids in _encode_texts(parts, dtype, spec.split_pieces):
            arrays += doc_ids + [eot]  # every document ends with EOT: the model learns where they end
            lengths.append(sum(len(a) for a in doc_ids) + 1)
        ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        if ids.size and int(ids.max()) >= spec.vocab_size:
            raise RuntimeError(f"{split} token id {int(ids.max())} >= vocab_size {spec.vocab_size}")
        out[split] = (ids, np.asarray(lengths, dtype=np.int64))
    return EncodedChunk(out["train"][0], out["val"][0], out["train"][1], out["val"][1],
                        sum(len(t.encode()) for t in texts), peak_resident_bytes(),
                        np.array([d for d, (head, _) in enumerate(heads_tails) if head], dtype=np.int64))


def peak_resident_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM, which starts afresh at exec; getrusage's
    ru_maxrss (KiB on Linux, bytes on macOS) elsewhere. On Linux ru_maxrss would carry the peak of
    whichever process exec'd this one (the forkserver is exec'd from a process holding torch)."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _encode_texts(texts: list[str], dtype: np.dtype, split_pieces: bool) -> list[list[np.ndarray]]:
    """Per text, the id arrays of its pieces. Pieces go to the tokenizer in batches of about
    `_BATCH_CHARS`, and each Encoding becomes a compact array at once: the tokenizer's objects
    (~100 bytes per token) never exist for more than one batch."""
    from meshlm.train.tokenizer import split_for_encoding

    tokenizer = _WORKER["tokenizer"]
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: ~2x faster
    # Tokenizers that are not GPT-2-like encode a document whole, unless it is over
    # _LONG_DOCUMENT_CHARS: then it too is cut, for bounded memory, at split_for_encoding's points
    # (before a space, or at a line start; forced after 8 pieces without one), which for another
    # tokenizer can change the ids next to the cut slightly (docs/data.md).
    pieces = [split_for_encoding(t) if split_pieces else split_for_encoding(t, _LONG_DOCUMENT_CHARS) for t in texts]
    flat = [piece for doc in pieces for piece in doc]
    arrays: list[np.ndarray] = []
    batch, size = [], 0
    for piece in flat + [None]:
        if piece is None or (batch and size + len(piece) > _BATCH_CHARS):
            arrays += [np.asarray(e.ids, dtype=dtype) for e in encode_batch(batch, add_special_tokens=False)]
            batch, size = [], 0
        if piece is not None:
            batch.append(piece)
            size += len(piece)
    result, next_piece = [], 0
    for doc in pieces:
        result.append(arrays[next_piece:next_piece + len(doc)])
        next_piece += len(doc)
    return result


# --------------------------------------------------------------------------- the pool


def default_workers() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


@contextlib.contextmanager
def _parent_main_hidden():
    """Workers started by forkserver or spawn import the parent's `__main__` module (as
    `__mp_main__`) before anything else. meshlm's CLI imports torch, so each worker took ~1 s of
    CPU for nothing: 16 workers encoded a 0.4 MB corpus in 16.8 s on 2 cores, and in 57.5 s on a
    16-core GPU machine whose CUDA torch is heavier. They need only this module (their functions
    are pickled by reference to it), so `__main__` shows neither a module name nor a file while
    they start: multiprocessing then leaves the child's main alone."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {key: main.__dict__[key] for key in ("__spec__", "__file__") if key in main.__dict__}
    main.__dict__["__spec__"] = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class EncoderPool:
    """`workers` processes, each holding the tokenizer; `imap` keeps results in input order and
    never has more than `_IN_FLIGHT_PER_WORKER * workers` chunks queued (multiprocessing's own
    imap reads its whole input ahead: unbounded memory on a large corpus)."""

    def __init__(self, spec: EncodeSpec, workers: int):
        self.workers = max(1, workers)
        self.pool = None
        if multiprocessing.current_process().daemon:
            # A daemonic process (a forked test rank, a rank that finds no cache) may not start
            # children: it encodes in itself, one chunk at a time, to the same tokens.
            self.workers = 1
            _init_worker(spec)
            return
        # forkserver: workers are forked from a small server process that imported only this
        # module, not from the caller (which may hold torch and a trained tokenizer: ~300 MB that
        # every forked worker would count as its own) and not after threads were started.
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload([__name__])
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        # Set while the workers start, so they inherit it: one encoding thread per worker.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            with _parent_main_hidden():
                self.pool = context.Pool(self.workers, _init_worker, (spec,))
        finally:
            if previous is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous

    def imap(self, chunks: Iterable[tuple[object, list[str]]]) -> Iterator[tuple[object, EncodedChunk]]:
        """(tag, encoded chunk) for every (tag, texts), in order."""
        if self.pool is None:
            yield from ((tag, encode_chunk(texts)) for tag, texts in chunks)
            return
        pending: deque = deque()
        limit = _IN_FLIGHT_PER_WORKER * self.workers
        for tag, texts in chunks:
            pending.append((tag, self.pool.apply_async(encode_chunk, (texts,))))
            if len(pending) >= limit:
                tag, result = pending.popleft()
                yield tag, result.get()
        while pending:
            tag, result = pending.popleft()
            yield tag, result.get()

    def __enter__(self) -> "EncoderPool":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is None:
            return
        if exc[0] is None:
            self.pool.close()
        else:
            self.pool.terminate()
        self.pool.join()
