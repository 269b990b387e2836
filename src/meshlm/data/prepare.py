"""Build one token cache: tokenizer, then stream documents through the encoder pool into shards.

Reduces: peak memory to (chunk size x chunks in flight) whatever the corpus size, preparation
time by the number of cores, and a killed preparation to the work since its last shard.
Costs: a hashing pass over the files (cache.content_digest), a sampling pass when meshlm trains
its own BPE on a large corpus, and the final merge of the shards (shards.py).

Steps, inside `<cache>/tokens/.building-<name>/` (a fixed name, so a rerun resumes it):
1. `build.json`: the recipe; a building directory with another recipe is started over.
2. `tokenizer.json`: meshlm's BPE trained on a bounded, evenly spread sample of the training
   text (`data.tokenizer_sample_bytes`), or the pretrained file byte for byte.
3. `shards/`: the encoded corpus (shards.py), resumed after the last complete shard.
4. `train.bin val.bin train.idx.npy val.idx.npy`, then `meta.json` last; the directory is renamed
   to its final name. Bad input (a ConfigError) discards the building directory, so a fixed
   corpus starts clean; any other failure or a kill leaves it to resume.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Callable

import numpy as np

from meshlm.data.cache import build_lock, is_complete
from meshlm.data.encode import (CHUNK_BYTES, EncodeSpec, EncoderPool, chunk_documents, peak_resident_bytes,
                                split_document)
from meshlm.data.shards import SHARD_CHUNKS, ShardWriter, read_json, write_json_atomically
from meshlm.durable import fsync_dir, replace_durably
from meshlm.errors import ConfigError
from meshlm.train.corpus import Corpus
from meshlm.train.tokenizer import (TOKENIZER_ALGORITHM, TOKENIZER_CONFIG, PretrainedTokenizer, chat_template, eot_id,
                                    load_tokenizer, split_for_encoding, splits_like_gpt2, train_tokenizer)

DATA_FORMAT_VERSION = 4  # 2: streamed shards, one file per split, document index; 3: no forced cuts in real
# text; 4: the held-out cut near val_fraction (short documents held out whole, by hash)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds ids 0 .. vocab_size-1: half the disk and page cache."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides a cache's content, and how to build it."""

    cache_dir: Path
    corpus: Corpus
    key_fields: dict  # what the cache key hashes: written to build.json and meta.json
    vocab_size: int
    val_fraction: float
    pretrained: PretrainedTokenizer | None
    tokenizer_sample_bytes: int
    workers: int
    chunk_bytes: int = CHUNK_BYTES
    shard_chunks: int = SHARD_CHUNKS


def build(plan: BuildPlan, log: Callable[[str], None]) -> None:
    """Make `plan.cache_dir` complete (or find it completed by a concurrent builder)."""
    plan.cache_dir.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(plan.cache_dir):
        if is_complete(plan.cache_dir):
            return
        building = plan.cache_dir.parent / f".building-{plan.cache_dir.name}"
        try:
            _build_in(building, plan, log)
        except ConfigError:  # bad input: the fixed corpus will have another key; nothing to resume
            shutil.rmtree(building, ignore_errors=True)
            raise
        building.chmod(0o755)  # a cache may be shared between users
        if plan.cache_dir.exists():  # a cache whose meta.json is torn: unreadable to all, replaced
            shutil.rmtree(plan.cache_dir)
        os.rename(building, plan.cache_dir)
        fsync_dir(plan.cache_dir.parent)


def _build_in(building: Path, plan: BuildPlan, log: Callable[[str], None]) -> None:
    recipe = {**plan.key_fields, "chunk_bytes": plan.chunk_bytes, "shard_chunks": plan.shard_chunks}
    if building.is_dir() and read_json(building / "build.json") != recipe:
        shutil.rmtree(building)
    building.mkdir(parents=True, exist_ok=True)
    write_json_atomically(building / "build.json", recipe)
    writer = ShardWriter(building / "shards", plan.shard_chunks)
    if is_complete(building):  # killed after meta.json, before the rename
        writer.remove()
        return
    tokenizer, eot = _tokenizer(building, plan, log)
    dtype = token_dtype(plan.vocab_size)
    resumed = writer.resume()
    spec = EncodeSpec(tokenizer.to_str(), eot, dtype.name, plan.vocab_size, plan.val_fraction,
                      split_pieces=plan.pretrained is None or splits_like_gpt2(tokenizer))
    start = time.perf_counter()
    chunks = chunk_documents(plan.corpus.documents(), plan.chunk_bytes)
    skipped = sum(size for _, _, size in islice(chunks, writer.done_chunks))  # consumed, not encoded
    if resumed:
        log(f"data: resuming {plan.corpus.label} after {resumed} complete shard(s) ({skipped / 1e6:.1f} MB)")
    progress = _progress(plan.corpus, skipped)
    tokens, worker_peak = 0, 0
    with EncoderPool(spec, plan.workers) as pool:
        for names, encoded in pool.imap((names, texts) for names, texts, _ in chunks):
            writer.add(encoded, names)
            tokens += len(encoded.train) + len(encoded.val)
            worker_peak = max(worker_peak, encoded.worker_peak_bytes)
            progress.update(encoded.text_bytes)
            progress.set_postfix_str(f"{tokens / 1e6:.1f}M tokens", refresh=False)
    progress.close()
    encoded_s = time.perf_counter() - start
    totals = writer.merge(building, dtype)
    meta = {"format": DATA_FORMAT_VERSION, "corpus": plan.corpus.label, "corpus_digest": plan.key_fields["corpus"],
            "documents": totals["documents"], "text_bytes": totals["text_bytes"], "vocab_size": plan.vocab_size,
            "tokenizer_vocab_size": tokenizer.get_vocab_size(), "tokenizer": TOKENIZER_ALGORITHM,
            "eot_id": eot, "dtype": dtype.name, "val_fraction": plan.val_fraction,
            "n_train_tokens": totals["train_tokens"], "n_val_tokens": totals["val_tokens"],
            "n_train_documents": totals["train_documents"], "n_val_documents": totals["val_documents"],
            "longest_documents": totals["longest"], "shards": totals["shards"], "key": plan.key_fields,
            "encode_seconds": round(encoded_s, 3), "workers": pool.workers,
            # Peak resident memory of this process and of the largest worker (of this run, when resumed).
            "main_peak_bytes": peak_resident_bytes(), "worker_peak_bytes": worker_peak}
    if plan.pretrained is not None:
        meta.update(tokenizer="pretrained", tokenizer_source=str(plan.pretrained.path),
                    tokenizer_sha256=plan.pretrained.sha256)
    write_json_atomically(building / "meta.json", meta)  # last: marks the cache complete
    writer.remove()
    n_tokens = totals["train_tokens"] + totals["val_tokens"]
    log(f"data: {totals['train_tokens']:,} train + {totals['val_tokens']:,} held-out tokens from "
        f"{totals['documents']:,} documents ({totals['text_bytes'] / max(1, n_tokens):.2f} bytes/token); "
        f"encoded in {encoded_s:.1f} s on {pool.workers} worker(s)")


def _progress(corpus: Corpus, done_bytes: int):
    """A bar on stderr with MB/s, tokens and ETA; silent when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=max(corpus.estimated_bytes(), done_bytes), initial=done_bytes, unit="B", unit_scale=True,
                desc=f"data: {corpus.label}", file=sys.stderr, disable=None, mininterval=1.0, leave=False)


# --------------------------------------------------------------------------- the tokenizer


def tokenizer_config_of(pretrained: PretrainedTokenizer) -> dict:
    """What a cache records beside a pretrained tokenizer.json: which of its tokens separates
    documents (tokenizer.run_end_token) and its chat template, if it has one; checkpoints and
    exports carry both (tokenizer.chat_template)."""
    template = chat_template(pretrained.path)
    return {"eos_token": pretrained.end_token, **({"chat_template": template} if template else {})}


def write_tokenizer_config(directory: Path, pretrained: PretrainedTokenizer) -> None:
    """`tokenizer_config_of` into `directory` (durable like every file the cache's meta.json vouches
    for). Also on a cache hit where it differs: the cache key hashes the tokenizer.json and its end
    token, not the template, which changes no token (a key with it would re-encode, and refuse the
    resume of, every run whose tokenizer has one); caches from before templates were carried have
    none. Two runs at once with one tokenizer.json and different templates: the last one prepared
    is what both carry."""
    config = tokenizer_config_of(pretrained)
    if read_json(directory / TOKENIZER_CONFIG) != config:
        write_json_atomically(directory / TOKENIZER_CONFIG, config)


def _tokenizer(building: Path, plan: BuildPlan, log: Callable[[str], None]):
    """(tokenizer, end-of-text id): the building directory's, else trained or copied now."""
    path = building / "tokenizer.json"
    if plan.pretrained is not None:
        if not path.is_file():  # the file itself, byte for byte: checkpoints and exports carry it exactly
            shutil.copyfile(plan.pretrained.path, building / ".tokenizer.json.tmp")
            replace_durably(building / ".tokenizer.json.tmp", path)
        write_tokenizer_config(building, plan.pretrained)
        log(f"data: encoding {plan.corpus.label} with {plan.pretrained.path} on {plan.workers} worker(s) ...")
        return plan.pretrained.tokenizer, plan.pretrained.end_id
    if path.is_file():  # resumed: the shards so far were encoded with exactly this one
        tokenizer = load_tokenizer(path)
        return tokenizer, eot_id(tokenizer)
    start = time.perf_counter()
    sample = tokenizer_sample(plan.corpus, plan.val_fraction, plan.tokenizer_sample_bytes)
    sample_bytes = sum(len(piece.encode()) for piece in sample)
    if not sample:
        raise ConfigError(f"data.path: {plan.corpus.label} has no training text to train a tokenizer on")
    log(f"data: training a {plan.vocab_size}-token byte-level BPE on a {sample_bytes / 1e6:.1f} MB sample of "
        f"{plan.corpus.label} ...")
    tokenizer = train_tokenizer(sample, plan.vocab_size)
    tokenizer.save(str(building / ".tokenizer.json.tmp"))
    replace_durably(building / ".tokenizer.json.tmp", path)  # resumed shards are read with it
    log(f"data: tokenizer trained in {time.perf_counter() - start:.1f} s")
    return tokenizer, eot_id(tokenizer)


def tokenizer_sample(corpus: Corpus, val_fraction: float, sample_bytes: int) -> list[str]:
    """At most ~`sample_bytes` of training text (document heads), spread evenly over the corpus:
    every k-th ~16 KB piece, k from the corpus's size on disk. Deterministic, so a resumed or
    repeated build trains the same tokenizer; the whole text when the corpus fits."""
    stride = max(1, -(-corpus.estimated_bytes() // sample_bytes))
    pieces, taken, index = [], 0, 0
    for _, text in corpus.documents():
        head, _ = split_document(text, val_fraction)
        for piece in split_for_encoding(head) if head else ():
            if index % stride == 0:
                pieces.append(piece)
                taken += len(piece)
            index += 1
        if taken >= sample_bytes:
            break
    return pieces
