"""Bad input to `data prepare`: each malformed file (broken JSON, a missing field or column, not
UTF-8, empty, corrupt or truncated archives, lone surrogates, unreadable files) is one line naming
the file, and the existing cache is left untouched; a tokenizer larger than the embedding names
the key."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from helpers import meshlm_in_process
from prepare_inputs import jsonl_lines, word_level_tokenizer
from prepare_inputs import offline  # noqa: F401  (autouse: every test here is offline)


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
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json")  # 202 ids
    (tmp_path / "a.txt").write_text("w1 w2 w3\n")
    proc = meshlm_in_process("data", "prepare", f"data.path={tmp_path / 'a.txt'}", f"data.tokenizer={tokenizer}",
                             "model.vocab_size=200", code=2)
    assert "model.vocab_size: 200 is smaller than the vocabulary of data.tokenizer" in proc.stderr
