"""What the data-preparation tests share (test_data_prepare.py, test_data_prepare_resume.py,
test_data_prepare_bad_input.py): a corpus of every input format, a small word-level tokenizer,
many small chunks and shards from a small corpus, and the autouse `offline` fixture each test
module imports (no download, a cache of its own)."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import pytest

from meshlm.data import prepare as prepare_module
from meshlm.train import corpus as corpus_module
from meshlm.train import data as data_module


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


def word_level_tokenizer(path: Path, setup=lambda tokenizer: None) -> Path:
    """A pretrained (word-level) tokenizer.json: ~4x faster than byte-level BPE, so the test spends
    its seconds on the pipeline whose memory it measures. `setup` may change it before it is saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(200)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    setup(tokenizer)
    tokenizer.save(str(path))
    return path
