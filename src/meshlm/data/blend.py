"""Blends: several prepared corpora mixed by weight (`data.blend = [[0.7, "web"], [0.3, "code"]]`).

Reduces: re-preparing a mixture whenever its weights change (each corpus is prepared once, and
weights act only at sampling time). Costs: one tokenizer for all corpora (the pretrained one, or
meshlm's BPE trained on the first corpus), and rounding of each weight to 1/1024.

Sampling, a pure function of (seed, sample number) like TokenLoader's: global samples come in
blocks of 1024; in every block corpus c gets exactly round(w_c * 1024) samples (largest
remainders), placed in an order drawn from (seed, block). The j-th sample of corpus c is window
perm_{c,e}[j mod n_c] of that corpus's epoch e = j // n_c, as in TokenLoader. So weights hold
block by block, any step is computed without replaying the run (exact resume, any layout), and
each corpus is seen without replacement within its own epochs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from meshlm.errors import ConfigError
from meshlm.train.data import TokenLoader, _gather_windows, eval_batches, prepare_data

BLOCK = 1024
_CORPUS_SEED_STRIDE = 7919  # corpus c's window order is drawn from seed + stride * (c + 1)


def parse_blend(blend: list, path: str | None = None) -> list[tuple[float, str]]:
    """[(weight / total, path), ...] from `data.blend`; a ConfigError naming the key otherwise."""
    if path is not None:
        raise ConfigError("data.blend: set data.blend or data.path, not both (a blend names its corpora)")
    if not isinstance(blend, list) or not blend:
        raise ConfigError(f"data.blend: expected a non-empty list of [weight, path], got {blend!r}")
    parts = []
    for i, entry in enumerate(blend):
        if (not isinstance(entry, list) or len(entry) != 2 or isinstance(entry[0], bool)
                or not isinstance(entry[0], (int, float)) or not isinstance(entry[1], str)):
            raise ConfigError(f"data.blend: entry {i} must be [weight, \"path\"], got {entry!r}")
        weight, corpus_path = float(entry[0]), entry[1]
        if not (weight > 0 and np.isfinite(weight)):
            raise ConfigError(f"data.blend: entry {i} has weight {entry[0]!r}; weights must be > 0")
        if not Path(corpus_path).expanduser().exists():
            raise ConfigError(f"data.blend: entry {i}: {corpus_path} does not exist")
        parts.append((weight, corpus_path))
    total = sum(weight for weight, _ in parts)
    quotas = block_quotas([weight / total for weight, _ in parts])
    for i, (quota, (weight, corpus_path)) in enumerate(zip(quotas, parts)):
        if quota == 0:  # below half a sample per block: it would be prepared, evaluated, never trained on
            raise ConfigError(f"data.blend: entry {i} ({corpus_path}) has weight {weight:g} of {total:g}, under one "
                              f"sample in each block of {BLOCK}: it would never be sampled")
    return [(weight / total, corpus_path) for weight, corpus_path in parts]


def prepare_blend(data_cfg, vocab_size: int, *, log: Callable[[str], None] = print):
    """A PreparedData whose `parts` are every corpus's cache, all encoded with one tokenizer."""
    from dataclasses import replace

    parts = parse_blend(data_cfg.blend, data_cfg.path)
    prepared, tokenizer = [], data_cfg.tokenizer
    for weight, corpus_path in parts:
        part = prepare_data(data_cfg, vocab_size, log=log, path=corpus_path, tokenizer=tokenizer)
        tokenizer = tokenizer or str(part.tokenizer_path)  # the first corpus's BPE encodes the rest
        prepared.append((weight, part))
    first = prepared[0][1]
    return replace(first, corpus="+".join(p.corpus for _, p in prepared),
                   cache_hit=all(p.cache_hit for _, p in prepared), parts=tuple(prepared))


def block_quotas(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Samples per corpus in one block: floor(w * block), then the largest remainders get one more."""
    exact = np.asarray(weights, dtype=np.float64) * block
    quotas = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - quotas), kind="stable")
    quotas[order[:block - quotas.sum()]] += 1
    return quotas


class BlendSampler:
    """Which corpus, and which of its samples, global sample g is: pure in (seed, g)."""

    def __init__(self, weights: list[float], seed: int, block: int = BLOCK):
        self.quotas = block_quotas(weights, block)
        self.block = block
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(corpus of each position, its running count within the block) for block b."""
        if b not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(min(self._orders))
            corpus = np.random.default_rng([self.seed, 0x626C656E64, b]).permutation(
                np.repeat(np.arange(len(self.quotas)), self.quotas))
            rank = np.empty(self.block, dtype=np.int64)
            for c in range(len(self.quotas)):
                mask = corpus == c
                rank[mask] = np.arange(mask.sum())
            self._orders[b] = (corpus, rank)
        return self._orders[b]

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus index, sample number within that corpus) of each global sample."""
        blocks, positions = np.divmod(samples, self.block)
        corpus = np.empty(len(samples), dtype=np.int64)
        local = np.empty(len(samples), dtype=np.int64)
        for b in np.unique(blocks):
            mask = blocks == b
            order, rank = self._order(int(b))
            corpus[mask] = order[positions[mask]]
            local[mask] = int(b) * self.quotas[corpus[mask]] + rank[positions[mask]]
        return corpus, local


def make_loader(data, seq_len: int, global_batch_size: int, seed: int):
    """The training loader of a PreparedData: a TokenLoader, or a BlendLoader for a blend."""
    if not data.parts:
        loader = TokenLoader(data.train_tokens(), seq_len, global_batch_size, seed)
    else:
        loader = BlendLoader([(w, p.train_tokens()) for w, p in data.parts], seq_len, global_batch_size, seed)
    loader.sources = data_sources(data)
    return loader


def data_sources(data) -> list[list]:
    """[weight, token cache directory name] per corpus: the name ends in the cache key, which hashes
    the corpus content, tokenizer, vocabulary, val_fraction and format (a loader's `sources`)."""
    return [[float(w), p.cache_dir.name] for w, p in (data.parts or ((1.0, data),))]


def eval_sets(data, seq_len: int, *, windows: int, batch_size: int) -> dict:
    """{corpus label: fixed held-out batches}, `windows` windows each in batches of `batch_size`:
    one entry, or one per corpus of a blend. Corpora whose labels (their directory names) coincide
    are told apart by their place in the blend, `train.1`, `train.2`: one entry each, or the later
    would replace the earlier."""
    parts = data.parts or ((1.0, data),)
    labels = [p.corpus for _, p in parts]
    names = [f"{label}.{i + 1}" if labels.count(label) > 1 else label for i, label in enumerate(labels)]
    return {name: eval_batches(p.val_tokens(), seq_len, windows=windows, batch_size=batch_size)
            for name, (_, p) in zip(names, parts)}


class BlendLoader(TokenLoader):
    """TokenLoader's interface (global/local/micro batches, state_dict) over a weighted blend."""

    sampling = "blend"  # its samples are drawn otherwise than TokenLoader's, even over one corpus

    def __init__(self, parts: list[tuple[float, np.ndarray]], seq_len: int, global_batch_size: int, seed: int):
        self.corpora = [TokenLoader(tokens, seq_len, global_batch_size, seed + _CORPUS_SEED_STRIDE * (c + 1))
                        for c, (_, tokens) in enumerate(parts)]
        self.sampler = BlendSampler([w for w, _ in parts], seed)
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.n_windows = sum(loader.n_windows for loader in self.corpora)
        self.next_step = 0
        self.sources = [[w, None] for w, _ in parts]  # TokenLoader.sources

    def _samples(self, first: int, count: int):
        corpus, local = self.sampler.assign(np.arange(first, first + count))
        inputs = torch.empty(count, self.seq_len, dtype=torch.int64)
        targets = torch.empty(count, self.seq_len, dtype=torch.int64)
        for c in np.unique(corpus):
            mask = corpus == c
            loader = self.corpora[int(c)]
            x, y = _gather_windows(loader.tokens, loader.windows_of(local[mask]), self.seq_len)
            rows = torch.from_numpy(np.flatnonzero(mask))
            inputs[rows], targets[rows] = x, y
        return inputs, targets
