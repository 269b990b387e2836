"""Streaming preparation (data/): every input format, identical tokens for any worker count and
equal to the tokenizer's own encoding, bounded memory, the BPE's sample, pretrained tokenizers,
the held-out share, `bench data`. Resume and durability are in test_data_prepare_resume.py, bad
input in test_data_prepare_bad_input.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import meshlm_in_process
from meshlm.config import ConfigError, DataConfig
from meshlm.data import prepare as prepare_module
from meshlm.data.encode import split_document
from meshlm.train.corpus import find_corpus
from meshlm.train.data import prepare_data
from meshlm.train.tokenizer import encode_documents
from prepare_inputs import SRC, jsonl_lines, small_chunks, word_level_tokenizer, write_mixed_corpus
from prepare_inputs import offline  # noqa: F401  (autouse: every test here is offline)


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


def test_a_zstd_file_of_several_frames_is_read_whole(tmp_path, monkeypatch):
    import zstandard

    from meshlm.data import readers

    monkeypatch.setattr(readers, "_ZSTD_BLOCK", 7)  # frames end inside blocks and at their edges
    texts = [f"frame document {i}" for i in range(300)]
    frames = [zstandard.ZstdCompressor().compress(jsonl_lines(texts[k:k + 100]).encode()) for k in (0, 100, 200)]
    (tmp_path / "x.jsonl.zst").write_bytes(b"".join(frames))
    assert [t for _, t in readers.read_documents(tmp_path / "x.jsonl.zst", "x", "text")] == texts


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
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json")
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
    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json", SAVED_SETTINGS[setting])
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

    tokenizer = word_level_tokenizer(tmp_path / "tokenizer.json")  # 202 ids
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
