"""Preparation that is killed and resumed (data/shards.py): a SIGKILL mid-build resumes at its
last complete shard and matches a fresh build, torn markers and meta.json are built again,
ShardWriter alone against sums computed here, and every marker and file on disk before the name
that vouches for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from meshlm.config import DataConfig
from meshlm.train.data import prepare_data
from prepare_inputs import SRC, small_chunks, word_level_tokenizer, write_mixed_corpus
from prepare_inputs import offline  # noqa: F401  (autouse: every test here is offline)


def test_a_killed_preparation_resumes_at_its_last_shard_and_matches_a_fresh_one(tmp_path, monkeypatch):
    write_mixed_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    # A child process that SIGKILLs itself as the third shard completes.
    script = textwrap.dedent(f"""
        import functools, os, signal, sys
        sys.path.insert(0, {SRC!r})
        from meshlm.config import DataConfig
        from meshlm.data import prepare, shards
        from meshlm.train import data
        data.BuildPlan = functools.partial(prepare.BuildPlan, chunk_bytes=1000, shard_chunks=2)
        close = shards.ShardWriter.close_shard
        def close_then_die(self):
            close(self)
            if len(self.done) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        shards.ShardWriter.close_shard = close_then_die
        data.prepare_data(DataConfig(path={str(tmp_path / 'corpus')!r}, cache_dir={str(cache)!r}, workers=2), 400)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    tokens_dir = cache / "tokens"
    [building] = [p for p in tokens_dir.iterdir() if p.name.startswith(".building-")]
    assert not [p for p in tokens_dir.iterdir() if not p.name.startswith(".") and p.name != "digests"]  # nothing complete
    assert sorted(p.name for p in (building / "shards").glob("*.json")) == ["00000.json", "00001.json", "00002.json"]

    small_chunks(monkeypatch)
    messages = []
    cfg = DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(cache), workers=2)
    resumed = prepare_data(cfg, 400, log=messages.append)
    assert any("after 3 complete shard(s)" in m for m in messages), messages
    assert not any("training a" in m for m in messages)  # the tokenizer of the shards is kept
    fresh = prepare_data(DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "fresh"), workers=1), 400,
                         log=lambda m: None)
    for split in ("train", "val"):
        assert np.array_equal(np.fromfile(resumed.cache_dir / f"{split}.bin", resumed.dtype),
                              np.fromfile(fresh.cache_dir / f"{split}.bin", fresh.dtype))
    assert (resumed.cache_dir / "tokenizer.json").read_bytes() == (fresh.cache_dir / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tokens_dir.iterdir()) == sorted(["digests", resumed.cache_dir.name])


def test_a_torn_shard_marker_or_meta_json_is_built_again_not_a_traceback(tmp_path, monkeypatch):
    """What a crash can leave where the rename reached the disk and the data did not: an empty
    marker (that shard and those after it are encoded again) or an empty meta.json (the cache is
    built again). Both were a JSONDecodeError at every later prepare."""
    from meshlm.data import shards as shards_module

    write_mixed_corpus(tmp_path / "corpus")
    small_chunks(monkeypatch)
    cfg = DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), workers=1)
    close = shards_module.ShardWriter.close_shard

    def close_then_fail(self):
        close(self)
        if len(self.done) == 3:
            raise RuntimeError("killed")

    monkeypatch.setattr(shards_module.ShardWriter, "close_shard", close_then_fail)
    with pytest.raises(RuntimeError, match="killed"):
        prepare_data(cfg, 400, log=lambda m: None)
    monkeypatch.setattr(shards_module.ShardWriter, "close_shard", close)
    [building] = (tmp_path / "cache" / "tokens").glob(".building-*")
    (building / "shards" / "00002.json").write_text("")
    messages = []
    resumed = prepare_data(cfg, 400, log=messages.append)
    assert any("after 2 complete shard(s)" in m for m in messages), messages
    fresh = prepare_data(DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "fresh"), workers=1), 400,
                         log=lambda m: None)
    assert np.array_equal(resumed.train_tokens(), fresh.train_tokens())

    (resumed.cache_dir / "meta.json").write_text('{"format": 4, "corp')
    again = prepare_data(cfg, 400, log=lambda m: None)
    assert not again.cache_hit and again.cache_dir == resumed.cache_dir
    assert np.array_equal(again.train_tokens(), fresh.train_tokens())
    assert np.array_equal(again.val_tokens(), fresh.val_tokens())


def synthetic_chunk(k: int, rng) -> tuple:
    """Chunk k: a few documents of random lengths, some held out whole (no train head)."""
    from meshlm.data.encode import EncodedChunk

    n = int(rng.integers(2, 6))
    lengths = rng.integers(1, 40, size=(2, n))
    train_index = np.flatnonzero(rng.random(n) < 0.8)
    train_lengths, val_lengths = lengths[0][train_index], lengths[1]
    train = (k * 1000 + np.arange(train_lengths.sum())).astype(np.uint16)
    val = (k * 1000 + 500 + np.arange(val_lengths.sum())).astype(np.uint16)
    names = [f"doc{k}.{i}" for i in range(n)]
    return EncodedChunk(train, val, train_lengths.astype(np.int64), val_lengths.astype(np.int64), text_bytes=100 + k,
                        worker_peak_bytes=0, train_index=train_index), names


def test_shards_hold_their_chunk_count_merge_to_the_concatenation_and_resume_deletes_the_rest(tmp_path):
    """ShardWriter alone, against sums computed here: a shard is marked after `shard_chunks`
    chunks; the merge is every chunk's tokens in order with offsets at every document's end,
    the totals and the longest train heads; resume keeps complete shards and deletes the rest."""
    from meshlm.data.shards import LONGEST_KEPT, ShardWriter

    rng = np.random.default_rng(0)
    chunks = [synthetic_chunk(k, rng) for k in range(7)]
    writer = ShardWriter(tmp_path / "shards", shard_chunks=3)
    assert writer.resume() == 0
    for k, (chunk, names) in enumerate(chunks):
        writer.add(chunk, names)
        assert len(writer.done) == (k + 1) // 3 and writer.done_chunks == 3 * ((k + 1) // 3)
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.json")) == ["00000.json", "00001.json"]
    out = tmp_path / "out"
    out.mkdir()
    totals = writer.merge(out, np.dtype(np.uint16))
    assert [shard["chunks"] for shard in writer.done] == [3, 3, 1] and totals["shards"] == 3
    for split in ("train", "val"):
        tokens = np.fromfile(out / f"{split}.bin", np.uint16)
        assert np.array_equal(tokens, np.concatenate([getattr(c, split) for c, _ in chunks]))
        lengths = np.concatenate([getattr(c, f"{split}_lengths") for c, _ in chunks])
        assert np.array_equal(np.load(out / f"{split}.idx.npy"), np.concatenate([[0], np.cumsum(lengths)]))
        assert totals[f"{split}_tokens"] == lengths.sum() and totals[f"{split}_documents"] == len(lengths)
    assert totals["documents"] == sum(len(names) for _, names in chunks)
    assert totals["text_bytes"] == sum(c.text_bytes for c, _ in chunks)
    heads = sorted(([int(c.train_lengths[i]), names[int(j)]] for c, names in chunks
                    for i, j in enumerate(c.train_index)), reverse=True)
    assert totals["longest"] == heads[:LONGEST_KEPT]
    # A kill during shard 2, with a later shard's files and a marker's temporary left behind:
    # shards 0 and 1 are kept, everything after them deleted (the directory is reread from disk).
    for name in ("00002.train.bin", "00003.json", "00003.val.bin", ".00002.json.tmp"):
        (tmp_path / "shards" / name).write_bytes(b"x")
    (tmp_path / "shards" / "00002.json").unlink()
    again = ShardWriter(tmp_path / "shards", shard_chunks=3)
    assert again.resume() == 2 and again.done == writer.done[:2]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == sorted(
        f"{k:05d}.{kind}" for k in (0, 1) for kind in ("json", "train.bin", "val.bin", "lengths.npz"))
    # A shard file shorter than its marker says (a disk that lost the tail): the merge refuses it.
    shard = tmp_path / "shards" / "00001.train.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    expected = 2 * sum(c.train_lengths.sum() for c, _ in chunks[:6])
    with pytest.raises(RuntimeError, match=f"train.bin has {expected - 2} bytes, expected {expected}$"):
        again.merge(out, np.dtype(np.uint16))


def test_json_markers_reach_the_disk_before_their_name_does(tmp_path, monkeypatch):
    from meshlm.data.shards import write_json_atomically

    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    write_json_atomically(tmp_path / "00000.json", {"chunks": 1})
    tmp = str(tmp_path / ".00000.json.tmp")
    assert events == [("fsync", tmp), ("replace", tmp, str(tmp_path / "00000.json")), ("fsync", str(tmp_path))]


def test_every_file_of_a_pretrained_tokenizers_cache_is_on_disk_before_meta_json(tmp_path, monkeypatch):
    """meta.json vouches for the whole cache: tokenizer_config.json (the end-of-text token that
    checkpoints and exports name) must be fsynced before it, as every other file is."""
    fsynced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(" ".join(f"w{i % 200}" for i in range(1000)))
    prepare_data(DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"),
                            tokenizer=str(tokenizer), workers=1), 256, log=lambda m: None)
    names = [Path(p).name for p in fsynced]
    assert ".tokenizer_config.json.tmp" in names
    assert names.index(".tokenizer_config.json.tmp") < names.index(".meta.json.tmp")
