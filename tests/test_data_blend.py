"""Blends (data/blend.py) and `meshlm data inspect`: weights reproduced within sampling error,
batches a pure function of (seed, step), exact resume, one tokenizer, per-corpus held-out sets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import meshlm_in_process
from meshlm.config import ConfigError, DataConfig, load_config, resolve
from meshlm.data.blend import BlendLoader, BlendSampler, block_quotas, eval_sets, make_loader, parse_blend
from meshlm.train import corpus as corpus_module
from meshlm.train.data import TokenLoader, prepare_data


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_module, "download_sdist", lambda dest: (_ for _ in ()).throw(RuntimeError("offline")))
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


def tagged_streams(sizes: list[int]) -> list[np.ndarray]:
    """Corpus c holds tokens c*1e6 + i: every row of a batch tells which corpus it came from."""
    return [c * 1_000_000 + np.arange(n, dtype=np.int64) for c, n in enumerate(sizes)]


def test_quotas_round_weights_to_the_block_exactly():
    assert block_quotas([0.5, 0.3, 0.2]).tolist() == [512, 307, 205]
    assert block_quotas([1 / 3] * 3).sum() == 1024
    assert block_quotas([0.999, 0.001]).tolist() == [1023, 1]


def test_a_weight_between_half_and_one_sample_a_block_gets_its_one_sample():
    """Largest remainders: 0.6 of a sample outranks 0.4 of one, though its corpus has no whole
    sample (a remainder taken as exact % floor(exact) is NaN there and ranked last)."""
    exact = np.array([0.9994, 0.0006]) * 1024  # 1023.39 and 0.61 samples
    assert block_quotas([0.9994, 0.0006]).tolist() == [1023, 1]
    assert block_quotas([0.0006, 0.9994]).tolist() == [1, 1023]
    assert np.all(np.abs(block_quotas([0.9994, 0.0006]) - exact) < 1)  # every quota rounds its exact share
    assert block_quotas([0.3, 0.0007, 0.6993]).tolist() == [307, 1, 716]


def test_sampled_frequencies_match_the_weights_within_sampling_error():
    weights = [0.6, 0.3, 0.1]
    loader = BlendLoader(list(zip(weights, tagged_streams([5000, 3000, 800]))), seq_len=8, global_batch_size=16, seed=5)
    rows = torch.cat([loader.global_batch(step)[0][:, 0] for step in range(300)])  # 4800 samples
    counts = np.bincount((rows // 1_000_000).numpy(), minlength=3)
    n = len(rows)
    for c, w in enumerate(weights):
        sigma = (n * w * (1 - w)) ** 0.5  # a multinomial's spread; quotas per block are tighter still
        assert abs(counts[c] - n * w) < 3 * sigma, (counts, weights)
    # Within each corpus: its windows without replacement, each once before any repeats.
    firsts = rows[(rows // 1_000_000) == 2] % 1_000_000
    windows = (800 - 1) // 8
    assert len(set(firsts[:windows].tolist())) == min(windows, len(firsts[:windows]))


def test_blend_batches_are_a_pure_function_of_seed_and_step_and_tile_over_dp():
    parts = list(zip([0.7, 0.3], tagged_streams([4000, 4000])))
    a, b = BlendLoader(parts, 8, 16, seed=1), BlendLoader(parts, 8, 16, seed=1)
    for step in (0, 3, 900):
        assert torch.equal(a.global_batch(step)[0], b.global_batch(step)[0])
        x, y = a.global_batch(step)
        assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one
        for dp in (2, 4):
            local = torch.cat([a.local_batch(step, r, dp)[0] for r in range(dp)])
            assert torch.equal(local, x)
    assert not torch.equal(a.global_batch(0)[0], BlendLoader(parts, 8, 16, seed=2).global_batch(0)[0])
    # Resume: the state is TokenLoader's (consumed samples), and a resumed loader replays exactly.
    run = BlendLoader(parts, 8, 16, seed=1)
    for step in range(4):
        run.microbatches(step, 0, 1, 8)
    resumed = BlendLoader(parts, 8, 16, seed=1)
    resumed.load_state_dict(run.state_dict())
    assert resumed.next_step == 4 and torch.equal(resumed.global_batch(4)[0], b.global_batch(4)[0])


def test_a_blends_samples_are_the_documented_draws_so_recorded_runs_replay():
    """Recomputed here from data/blend.py's rule: block b orders its quotas by a permutation drawn
    from (seed, "blend", b); the j-th sample of corpus c is window perm[j mod n_c] of its epoch
    j // n_c, perm drawn from (seed + 7919 (c + 1), epoch). Another draw would still sample well,
    but every recorded blend run would replay other batches."""
    weights, seed, seq = [0.5, 0.3, 0.2], 11, 8
    streams = tagged_streams([3000, 2000, 400])  # corpus 2: 49 windows, many epochs
    x = torch.cat([BlendLoader(list(zip(weights, streams)), seq, 16, seed).global_batch(s)[0] for s in range(70)])
    quotas = np.array([512, 307, 205])
    orders = {b: np.random.default_rng([seed, int.from_bytes(b"blend", "big"), b]).permutation(np.repeat(np.arange(3), quotas))
              for b in (0, 1)}
    windows = {}
    for g in range(len(x)):  # 1120 samples: into the second block
        b, position = divmod(g, 1024)
        c = orders[b][position]
        j = b * quotas[c] + int((orders[b][:position] == c).sum())
        n = (len(streams[c]) - 1) // seq
        epoch, i = divmod(j, n)
        if (c, epoch) not in windows:
            windows[c, epoch] = np.random.default_rng([seed + 7919 * (c + 1), epoch]).permutation(n)
        assert x[g, 0] == streams[c][windows[c, epoch][i] * seq], g


def test_sampler_maps_each_corpus_onto_its_own_sample_numbers_once():
    sampler = BlendSampler([0.5, 0.25, 0.25], seed=0)
    corpus, local = sampler.assign(np.arange(3 * 1024))
    for c in range(3):
        assert sorted(local[corpus == c].tolist()) == list(range(int((corpus == c).sum())))


def test_a_loader_state_loads_only_into_the_same_data():
    """A state saved over one blend (or corpus) loaded into another without complaint: the
    checkpoint's position was then replayed over other windows."""
    a, b = np.arange(5000, dtype=np.uint16), np.arange(5000, 9000, dtype=np.uint16)
    old = BlendLoader([(0.9, a), (0.1, b)], 8, 16, seed=0)
    old.global_batch(9)
    state = old.state_dict()
    with pytest.raises(ValueError, match="saved over 0.9 x a corpus \\+ 0.1 x a corpus, this run reads 0.1"):
        BlendLoader([(0.1, a), (0.9, b)], 8, 16, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="this run reads 1 x a corpus"):
        TokenLoader(np.arange(3000, dtype=np.uint16), 8, 16, 0).load_state_dict(state)
    named = TokenLoader(a, 8, 16, 0)
    named.sources = [[1.0, "web-v512-0123456789abcdef"]]
    other = TokenLoader(a, 8, 16, 0)
    other.sources = [[1.0, "web-v512-fedcba9876543210"]]  # the same corpus, its content or tokenizer changed
    with pytest.raises(ValueError, match="web-v512-0123456789abcdef"):
        other.load_state_dict(named.state_dict())
    same = BlendLoader([(0.9, a), (0.1, b)], 8, 16, seed=0)
    same.load_state_dict(state)
    assert same.next_step == 10
    older = {k: v for k, v in named.state_dict().items() if k != "sources"}  # a checkpoint from before
    other.load_state_dict(older)


def test_the_same_weights_written_otherwise_resume_either_way(tmp_path):
    """[7, 2, 1] and [0.7, 0.2, 0.1] are one blend, though their normalised weights differ in the
    last bit (0.7 and 0.7000000000000001): a checkpoint of either resumes under the other."""
    (tmp_path / "a.txt").write_text("text\n")
    corpus = np.arange(5000, dtype=np.uint16)

    def loader(weights):
        parts = parse_blend([[w, str(tmp_path / "a.txt")] for w in weights])
        return BlendLoader([(w, corpus) for w, _ in parts], 8, 16, seed=0)

    whole, fractions = loader([7, 2, 1]), loader([0.7, 0.2, 0.1])
    assert whole.sources != fractions.sources  # not the same floats
    for saved, resumed in ((whole, loader([0.7, 0.2, 0.1])), (fractions, loader([7, 2, 1]))):
        saved.global_batch(5)
        resumed.load_state_dict(saved.state_dict())
        assert resumed.next_step == 6
    with pytest.raises(ValueError, match="saved over 0.7 x a corpus"):
        loader([6, 3, 1]).load_state_dict(whole.state_dict())


def test_blend_config_errors_name_the_key(tmp_path):
    (tmp_path / "a.txt").write_text("text\n")
    good = [[0.7, str(tmp_path / "a.txt")], [0.3, str(tmp_path / "a.txt")]]
    assert parse_blend(good) == [(0.7, str(tmp_path / "a.txt")), (0.3, str(tmp_path / "a.txt"))]
    assert len(parse_blend([[1000, str(tmp_path / "a.txt")], [0.6, str(tmp_path / "a.txt")]])) == 2  # 0.61 samples: 1
    for blend, words in [([], "non-empty"), ([[0, str(tmp_path / "a.txt")]], "weights must be > 0"),
                         ([[1, str(tmp_path / "a.txt"), "x"]], "entry 0 must be \\[weight"),  # three fields
                         ([[True, str(tmp_path / "a.txt")]], "entry 0 must be \\[weight"),  # a bool is no weight
                         # 0.4 of 1000.4 is 0.41 samples a block: rounded to none (the weights normalised)
                         ([[1000, str(tmp_path / "a.txt")], [0.4, str(tmp_path / "a.txt")]], "entry 1 .* under one"),
                         ([[1, str(tmp_path / "missing")]], "does not exist"), ([["x", "y"]], "must be \\[weight"),
                         # under half a sample in each block of 1024: rounded to none, never trained on
                         ([[1, str(tmp_path / "a.txt")], [0.0004, str(tmp_path / "a.txt")]],
                          "entry 1 .* under one sample in each block of 1024: it would never be sampled")]:
        with pytest.raises(ConfigError, match=f"^data.blend: .*{words}"):
            parse_blend(blend)
    with pytest.raises(ConfigError, match="^data.blend: .*not both"):
        resolve(load_config(None, [f"data.blend={json.dumps(good)}", f"data.path={tmp_path / 'a.txt'}"]))
    cfg = resolve(load_config(None, [f"data.blend={json.dumps(good)}"]))
    assert cfg.data.blend == good


def write_two_corpora(tmp_path):
    (tmp_path / "prose").mkdir()
    (tmp_path / "prose" / "a.txt").write_text("".join(f"Prose line {i} about the sea and ships.\n" for i in range(400)))
    (tmp_path / "code.jsonl").write_text("".join(
        json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 8}) + "\n" for i in range(150)))
    return [[3, str(tmp_path / "prose")], [1, str(tmp_path / "code.jsonl")]]


def test_a_prepared_blend_shares_one_tokenizer_and_evaluates_each_corpus(tmp_path):
    blend = write_two_corpora(tmp_path)
    cfg = DataConfig(blend=blend, cache_dir=str(tmp_path / "cache"), workers=1, val_fraction=0.1)
    data = prepare_data(cfg, 320, log=lambda m: None)
    (w0, prose), (w1, code) = data.parts
    assert (w0, w1) == (0.75, 0.25) and prose.corpus == "prose" and code.corpus == "code.jsonl"
    assert prose.tokenizer_path.read_bytes() == code.tokenizer_path.read_bytes()  # the first corpus's BPE
    sets = eval_sets(data, 16, windows=4, batch_size=2)
    assert list(sets) == ["prose", "code.jsonl"] and all(len(batches) == 2 for batches in sets.values())
    assert isinstance(make_loader(data, 16, 8, 0), BlendLoader)
    assert prepare_data(cfg, 320, log=lambda m: None).cache_hit  # prepared once
    single = prepare_data(DataConfig(path=blend[0][1], cache_dir=str(tmp_path / "cache")), 320, log=lambda m: None)
    assert isinstance(make_loader(single, 16, 8, 0), TokenLoader) and list(eval_sets(single, 16, windows=4, batch_size=2)) == ["prose"]


def test_a_single_corpus_is_the_whole_of_what_a_loader_reads(tmp_path):
    """Its sources are [[1, its cache]], as a blend's weights sum to 1: a state saved over one
    corpus, loaded over another, names both caches, each as the whole of its run's data."""
    blend = write_two_corpora(tmp_path)
    prose, code = (prepare_data(DataConfig(path=p, cache_dir=str(tmp_path / "cache"), workers=1), 320,
                                log=lambda m: None) for _, p in blend)
    saved = make_loader(prose, 16, 8, 0)
    assert saved.sources == [[1.0, prose.cache_dir.name]]
    with pytest.raises(ValueError, match=f"saved over 1 x {prose.cache_dir.name}, this run reads 1 x "
                                         f"{code.cache_dir.name};"):
        make_loader(code, 16, 8, 0).load_state_dict(saved.state_dict())


def test_a_blend_of_one_corpus_and_that_corpus_alone_do_not_resume_each_other(tmp_path, monkeypatch):
    """`data.blend = [[1, X]]` and `data.path = X` share a token cache, so their sources are the
    same, but a blend draws the corpus's windows with its own seed: the same step is another batch.
    A checkpoint of one resumed under the other (by the ranks, and by the launcher's check) was
    accepted and replayed other windows."""
    from meshlm.train.checkpoint import resume as resume_module

    corpus = write_two_corpora(tmp_path)[0][1]
    cache = str(tmp_path / "cache")
    single = prepare_data(DataConfig(path=corpus, cache_dir=cache, workers=1), 320, log=lambda m: None)
    blend = prepare_data(DataConfig(blend=[[1, corpus]], cache_dir=cache, workers=1), 320, log=lambda m: None)
    alone, blended = make_loader(single, 16, 8, 0), make_loader(blend, 16, 8, 0)
    assert alone.sources == blended.sources  # one cache, weight 1
    assert not torch.equal(alone.global_batch(3)[0], blended.global_batch(3)[0])  # why neither may resume the other
    for saved, other, words in ((alone, make_loader(blend, 16, 8, 0), "single corpus .*, this run reads over a blend"),
                                (blended, make_loader(single, 16, 8, 0), "blend .*, this run reads over a single")):
        with pytest.raises(ValueError, match=words):
            other.load_state_dict(saved.state_dict())
    for loader, data in ((alone, single), (blended, blend)):  # each resumes its own kind
        fresh = make_loader(data, 16, 8, 0)
        fresh.load_state_dict(loader.state_dict())
        assert fresh.next_step == 4 and torch.equal(fresh.global_batch(4)[0], loader.global_batch(4)[0])

    states = {}  # what the launcher reads of a checkpoint: its meta.json's loader state
    monkeypatch.setattr(resume_module, "CheckpointReader", lambda path: type("R", (), {"meta": {"data": states[path]}}))
    for saved, data, cfg, key in ((alone, blend, DataConfig(blend=[[1, corpus]]), "data.blend"),
                                  (blended, single, DataConfig(path=corpus), "data.path")):
        states[tmp_path] = saved.state_dict()
        with pytest.raises(ConfigError, match=f"^{key}: checkpoint .* trained on 1 x {single.cache_dir.name} over a"):
            resume_module.check_same_data(tmp_path, data, type("Cfg", (), {"data": cfg}))
        resume_module.check_same_data(tmp_path, single if data is blend else blend, type("Cfg", (), {"data": cfg}))


def test_corpora_with_the_same_directory_name_are_evaluated_each(tmp_path):
    """`a/prose` and `b/prose`: two held-out sets (a dict keyed by the label alone kept one)."""
    for sub, word in (("a", "sea"), ("b", "hill")):
        (tmp_path / sub / "prose").mkdir(parents=True)
        (tmp_path / sub / "prose" / "x.txt").write_text("".join(f"Line {i} about the {word}.\n" for i in range(300)))
    blend = [[1, str(tmp_path / "a" / "prose")], [1, str(tmp_path / "b" / "prose")]]
    data = prepare_data(DataConfig(blend=blend, cache_dir=str(tmp_path / "cache"), workers=1, val_fraction=0.1), 320,
                        log=lambda m: None)
    sets = eval_sets(data, 16, windows=4, batch_size=2)
    assert list(sets) == ["prose.1", "prose.2"]
    assert not torch.equal(sets["prose.1"][0][0], sets["prose.2"][0][0])  # each its own corpus's text


def test_inspect_reports_documents_tokens_longest_and_epochs_with_a_warning(tmp_path):
    blend = write_two_corpora(tmp_path)
    args = [f"data.blend={json.dumps(blend)}", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1",
            "model.vocab_size=320", "train.steps=200", "train.seq_len=32", "train.global_batch_size=16"]
    report = json.loads(meshlm_in_process("data", "inspect", "--json", *args).stdout)
    prose, code = report["corpora"]
    assert (prose["documents"], code["documents"]) == (1, 150)
    assert code["longest_documents"][0]["tokens"] >= code["longest_documents"][-1]["tokens"] > 0
    assert code["bytes_per_token"] > 1 and prose["weight"] == 0.75
    windows = (code["n_train_tokens"] - 1) // 32
    assert code["epochs"] == pytest.approx(200 * 16 * 0.25 / windows, rel=1e-3)
    assert (code["epochs"] >= 4) == any(w.startswith("code.jsonl is seen") for w in report["warnings"])
    text = meshlm_in_process("data", "inspect", *args).stdout
    assert "longest:" in text and "epochs over this run" in text


def test_training_on_a_blend_logs_each_corpus_held_out_loss(tmp_path):
    blend = write_two_corpora(tmp_path)
    run_dir = tmp_path / "run"
    meshlm_in_process("train", "model.preset=debug", "model.vocab_size=320", f"data.blend={json.dumps(blend)}",
                      f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2", "train.eval_interval=2",
                      "train.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=2",
                      "train.eval_batches=2", "run.sample_tokens=0", f"run.dir={run_dir}")
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    per_corpus = [last["eval_loss/prose"], last["eval_loss/code.jsonl"]]
    # Both held-out sets have the same number of full windows: the overall loss is their mean.
    assert last["eval_loss"] == pytest.approx(sum(per_corpus) / 2, rel=1e-6)
