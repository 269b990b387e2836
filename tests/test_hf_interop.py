"""Hugging Face import: `model.init_from` of a transformers Llama (or of an export, or of a
checkpoint) gives every layout the same weights and logits, `meshlm import` makes a run directory
of one, llama3 rope scaling survives import, training and export; bad sources are one line and
exit 2 (1 for a corrupt checkpoint). Export: test_hf_export.py."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.cli import main as meshlm_main
from meshlm.config import ConfigError
from meshlm.testing import run_ranks
from meshlm.train.checkpoint import save_checkpoint
from meshlm.train.checkpoint.hf import hf_name
from meshlm.train.checkpoint.hf_import import init_from
from meshlm.train.checkpoint.hf_export import export_hf
from meshlm.train.tokenizer import encode, load_tokenizer

from helpers import build_trainer, read_metrics, run_meshlm, small_cfg
from hf_saved import in_process_fails, meshlm_fails, scaled_weights, small_args

transformers = pytest.importorskip("transformers")


def random_hf_llama(out: Path, tied: bool, shard: bool, rope: dict | None = None):
    """A transformers Llama with random weights (GQA; vocab 512 so the offline corpus's BPE cache
    is shared), saved with save_pretrained (sharded into several files when `shard`); `rope`: its
    rope_parameters beyond rope_theta (default: no scaling)."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, **(rope or {})})
    torch.manual_seed(11)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.1)
    hf.save_pretrained(out, max_shard_size="60KB" if shard else "1GB")
    assert (out / "model.safetensors.index.json").exists() == shard
    return hf


def imported(corpus, run_dir, world_size, source, extra):
    trainer = build_trainer(small_cfg(corpus, run_dir, world_size, f"model.init_from={source}", *extra))
    init_from(trainer, source)
    full = {k: v.detach().clone() for k, v in trainer.full_state_dict().items()}
    logits = None
    if world_size == 1:
        with torch.no_grad():
            logits = trainer.model(torch.arange(40).view(2, 20) * 7 % 512)
    # The held-out loss runs every stage: it sees a last stage's copy of a tied head, too.
    return full, logits, trainer.evaluate(), trainer.eval_set, trainer.step


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-models")
    return {tied: (root / str(tied), random_hf_llama(root / str(tied), tied, shard=not tied)) for tied in (False, True)}


@pytest.mark.parametrize("tied,world,layout", [
    (False, 1, []), (False, 2, ["parallel.tp=2"]), (False, 2, ["parallel.pp=2"]),
    (False, 2, ["parallel.zero=2"]),  # flat shards: here one starts mid-way through a norm vector
    (True, 1, []), (True, 2, ["parallel.pp=2"]),
])
def test_init_from_transformers_gives_every_layout_its_weights(corpus, tmp_path, hf_models, tied, world, layout):
    source, hf = hf_models[tied]
    args = (corpus, tmp_path, world, source, layout)
    full, logits, eval_loss, eval_set, step = (imported(*args) if world == 1
                                               else run_ranks(imported, world, *args, timeout=120)[0])
    theirs = hf.state_dict()
    assert step == 0 and set(map(hf_name, full)) | ({"lm_head.weight"} if tied else set()) == set(theirs)
    for name, value in full.items():
        assert torch.equal(value, theirs[hf_name(name)]), name
    if logits is not None:
        with torch.no_grad():
            expected = hf(input_ids=torch.arange(40).view(2, 20) * 7 % 512).logits
        assert logits.abs().max() > 1.0 and (logits - expected).abs().max() <= 1e-4
    with torch.no_grad():
        hf_loss = sum(hf(input_ids=x).logits.flatten(0, 1).double().log_softmax(-1)
                      .gather(1, y.view(-1, 1)).sum().neg() for x, y in eval_set) / sum(y.numel() for _, y in eval_set)
    assert eval_loss == pytest.approx(hf_loss.item(), abs=1e-5)


def test_config_comes_from_the_source_and_contradictions_name_the_key(corpus, tmp_path, hf_models):
    source, _ = hf_models[True]
    cfg = small_cfg(corpus, tmp_path, 1, f"model.init_from={source}")  # the debug preset says otherwise
    m = cfg.model
    assert (m.dim, m.ffn_dim, m.n_kv_heads, m.max_seq_len, m.rope_theta, m.norm_eps, m.tie_embeddings) == \
           (64, 96, 2, 128, 5000.0, 1e-6, True)
    assert cfg.data.tokenizer is None  # save_pretrained wrote no tokenizer: the data trains its BPE
    for dim in (128, 32):  # larger or smaller than the source's 64
        with pytest.raises(ConfigError, match=rf"^model\.dim: {dim} contradicts"):
            small_cfg(corpus, tmp_path, 1, f"model.init_from={source}", f"model.dim={dim}")


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def legacy_rope_scaling(source: Path, out: Path) -> None:
    """`source` rewritten as transformers 4 saved Llama 3.1 / 3.2: `rope_scaling` and a top-level
    rope_theta, no rope_parameters."""
    import shutil

    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_a_llama3_scaled_model_imports_trains_and_exports_with_its_scaling(corpus, saved, tmp_path, spelling):
    """init_from a Llama with llama3 rope scaling (transformers 5's or 4's spelling): the config
    takes its scaling and the logits equal transformers' past the original context; one training
    step, then the export carries the same rope keys back, and transformers computes the trained
    model's logits from it."""
    hf = random_hf_llama(tmp_path / "hf5", tied=False, shard=False, rope=LLAMA3_ROPE)
    source = tmp_path / "hf5"
    if spelling == "rope_scaling":
        legacy_rope_scaling(source, tmp_path / "hf4")
        source = tmp_path / "hf4"
        assert transformers.AutoConfig.from_pretrained(source).rope_parameters == {**LLAMA3_ROPE, "rope_theta": 5000.0}
    cfg = small_cfg(corpus, tmp_path / "run", 1, f"model.init_from={source}", "train.seq_len=64", steps=2)
    m = cfg.model
    assert (m.rope_scaling, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
            m.rope_original_max_seq_len, m.rope_theta) == ("llama3", 32.0, 1.0, 4.0, 32, 5000.0)
    trainer = build_trainer(cfg)
    init_from(trainer, source)
    tokens = torch.arange(192).view(2, 96) * 7 % 512
    with torch.no_grad():
        ours, theirs = trainer.model(tokens), hf(input_ids=tokens).logits
    assert ours.abs().max() > 1.0 and (ours - theirs).abs().max() <= 1e-4
    trainer.train_step()
    save_checkpoint(trainer, tmp_path / "run" / "checkpoints", keep=2)
    export_hf(tmp_path / "run", tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 5000.0} and config["rope_theta"] == 5000.0
    assert config["rope_scaling"] == LLAMA3_ROPE  # what transformers 4 reads
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert exported.config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 5000.0}
    with torch.no_grad():
        ours, theirs = trainer.model(tokens), exported(input_ids=tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4
    # a meshlm checkpoint as init_from carries the scaling too, and so does the export imported again
    from_checkpoint = small_cfg(corpus, tmp_path / "ckpt", 1, f"model.init_from={tmp_path / 'run'}", "train.seq_len=64")
    assert dataclasses.replace(from_checkpoint.model, init_from=None) == dataclasses.replace(m, init_from=None)
    again = small_cfg(corpus, tmp_path / "again", 1, f"model.init_from={tmp_path / 'export'}", "train.seq_len=64")
    assert dataclasses.replace(again.model, init_from=None) == dataclasses.replace(m, init_from=None)


def test_generate_from_an_imported_llama3_model_equals_transformers(saved, tmp_path, capsys):
    """`meshlm import` of a Llama 3.2-style directory (legacy rope_scaling), then `meshlm generate`
    greedily past the original context: the tokens transformers' generate picks."""
    _, checkpoint, _ = saved("single-untied")
    hf = random_hf_llama(tmp_path / "hf5", tied=True, shard=False, rope=LLAMA3_ROPE)
    legacy_rope_scaling(tmp_path / "hf5", tmp_path / "hf4")
    import shutil

    shutil.copyfile(checkpoint / "tokenizer.json", tmp_path / "hf4" / "tokenizer.json")  # vocab 512, as the model
    assert meshlm_main(["import", "--hf", str(tmp_path / "hf4"), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    n_new = 60
    assert meshlm_main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "ROMEO:", "--temperature", "0",
                        "--max-new-tokens", str(n_new)]) == 0
    ours = capsys.readouterr().out[:-1]
    tok = load_tokenizer(checkpoint / "tokenizer.json")
    prompt = torch.tensor([encode(tok, "ROMEO:")])
    hf.generation_config.eos_token_id = None
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n_new)
    assert out.shape[1] == prompt.shape[1] + n_new > 32
    assert tok.decode(out[0].tolist(), skip_special_tokens=False) == ours


def test_init_from_a_run_directory_starts_from_its_newest_checkpoint(corpus, saved, tmp_path, capsys):
    """As generate and export take a run directory; config.toml records the checkpoint it meant.
    A run's final/ is refused with the way round, naming the key."""
    from meshlm.train.weights import save_final

    run_dir, checkpoint, _ = saved("single-untied")
    cfg = small_cfg(corpus, tmp_path, 1, f"model.init_from={run_dir}")
    assert cfg.model.init_from == str(checkpoint)
    save_final(scaled_weights(cfg.model), cfg, checkpoint / "tokenizer.json", tmp_path / "done")
    with pytest.raises(ConfigError, match=r"^model\.init_from: .*final is a meshlm final/ directory: start from"):
        small_cfg(corpus, tmp_path, 1, f"model.init_from={tmp_path / 'done' / 'final'}")


def test_training_from_an_export_equals_training_from_its_checkpoint(corpus, saved, tmp_path):
    """Weights-only start from the checkpoint and from its export: the same losses, bit for bit
    (the export is exact fp32). Also through `meshlm train`: step 0 on, the same first loss."""
    _, checkpoint, _ = saved("single-untied")
    export_hf(checkpoint, tmp_path / "hf")

    def losses(source, run_dir):
        trainer = build_trainer(small_cfg(corpus, run_dir, 1, f"model.init_from={source}", steps=3))
        assert trainer.cfg.data.tokenizer == str(source)  # the tokenizer came along
        init_from(trainer, source)
        return [trainer.train_step().loss for _ in range(3)]

    from_checkpoint = losses(checkpoint, tmp_path / "a")
    assert losses(tmp_path / "hf", tmp_path / "b") == from_checkpoint
    run_dir = tmp_path / "cli"
    proc = run_meshlm("train", "model.preset=debug", f"model.init_from={tmp_path / 'hf'}",
                      *small_args(corpus, run_dir), "train.steps=2", "run.sample_tokens=0", in_process=True)
    assert f"initialised from {tmp_path / 'hf'}" in proc.stdout + proc.stderr
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == pytest.approx(from_checkpoint[0], abs=1e-6)


def test_pretrained_tokenizer_encodes_the_data_and_keys_the_cache(corpus, saved, tmp_path):
    from meshlm.train.data import prepare_data

    _, checkpoint, _ = saved("single-untied")
    default = small_cfg(corpus, tmp_path, 1)
    pretrained = small_cfg(corpus, tmp_path, 1, f"data.tokenizer={checkpoint}")
    a = prepare_data(default.data, 512, log=lambda m: None)
    b = prepare_data(pretrained.data, 512, log=lambda m: None)
    assert a.cache_dir != b.cache_dir  # keyed by the tokenizer file's content, not the recipe
    # The tokenizer the default cache trained, given back as a file: the same tokens.
    assert (b.train_tokens() == a.train_tokens()).all() and b.eot_id == a.eot_id
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 300 is smaller than the vocabulary"):
        small_cfg(corpus, tmp_path, 1, f"data.tokenizer={checkpoint}", "model.vocab_size=300")


def test_bad_init_from_is_one_line_exit_2(corpus, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "empty").mkdir()
    train = ["train", "model.preset=debug", f"run.dir={tmp_path / 'run'}"]
    line = meshlm_fails(*train, f"model.init_from={tmp_path / 'missing'}", code=2)
    assert "model.init_from" in line and "does not exist" in line
    assert "'gpt2'" in in_process_fails(capsys, *train, f"model.init_from={gpt2}", code=2)
    assert "no config.json" in in_process_fails(capsys, *train, f"model.init_from={tmp_path / 'empty'}", code=2)
    # a default rope_parameters beside a legacy rope_scaling that transformers also applies
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(json.dumps({
        "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        "rope_scaling": {"type": "linear", "factor": 4.0}}))
    line = in_process_fails(capsys, *train, f"model.init_from={scaled}", code=2)
    assert "rope scaling 'linear' is not supported" in line
    # llama3 is the one scaling meshlm computes: every other type stays refused, in either key, even
    # beside a llama3 one; a llama3 without its numbers is refused naming the missing one
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for rope, expected in [({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn' is not"),
                           ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not"),
                           ({"rope_scaling": llama3, "rope_parameters": {"rope_type": "longrope"}}, "'longrope' is not"),
                           ({"rope_scaling": {**llama3, "factor": None}}, "llama3 rope scaling has no number factor"),
                           ({"rope_scaling": {**llama3, "factor": 0.5}}, "scaling gives model.rope_factor: must be >= 1"),
                           ({"rope_parameters": {**llama3, "high_freq_factor": 1.0}},
                            "gives model.rope_high_freq_factor: 1.0 must exceed")]:
        (scaled / "config.json").write_text(json.dumps({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 512, **rope}))
        line = in_process_fails(capsys, *train, f"model.init_from={scaled}", code=2)
        assert expected in line and line.startswith("meshlm: error: model.init_from: "), line


def test_an_unreadable_init_from_source_is_one_line_naming_the_file(saved, hf_models, tmp_path, capsys):
    """A weights file that is not safetensors, an index without its weight_map, a head_dim that is
    not hidden_size / heads (the quotient named), a config.json without a key it needs, tensors
    larger than its model's, a checkpoint whose manifest cannot be read: exit 2, one line naming
    model.init_from and the file."""
    train = ["train", "model.preset=debug", f"run.dir={tmp_path / 'run'}"]
    single, sharded = shutil.copytree(hf_models[True][0], tmp_path / "single"), shutil.copytree(hf_models[False][0],
                                                                                               tmp_path / "sharded")
    (single / "model.safetensors").write_bytes(b"\x08" + bytes(64))
    line = in_process_fails(capsys, *train, f"model.init_from={single}", code=2)
    assert line.startswith(f"meshlm: error: model.init_from: {single / 'model.safetensors'}: not a safetensors file")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    line = in_process_fails(capsys, *train, f"model.init_from={sharded}", code=2)
    assert line == f"meshlm: error: model.init_from: {sharded / 'model.safetensors.index.json'} has no weight_map"
    config = json.loads((hf_models[True][0] / "config.json").read_text())
    (single / "config.json").write_text(json.dumps({**config, "head_dim": 8}))  # 64 / 4 heads = 16
    line = in_process_fails(capsys, *train, f"model.init_from={single}", code=2)
    assert "head_dim 8 != hidden_size / num_attention_heads = 16;" in line, line
    (single / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "intermediate_size"}))
    line = in_process_fails(capsys, *train, f"model.init_from={single}", code=2)
    assert line == f"meshlm: error: model.init_from: {single / 'config.json'} has no intermediate_size"
    wider = shutil.copytree(hf_models[True][0], tmp_path / "wider")  # tensors larger than config.json's model
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    line = in_process_fails(capsys, *train, f"model.init_from={wider}", code=2)
    assert "mlp" in line and ("has shape [96, 64], the model of its config.json needs [80, 64]" in line
                              or "has shape [64, 96], the model of its config.json needs [64, 80]" in line), line
    checkpoint = shutil.copytree(saved("single-untied")[1], tmp_path / "checkpoint")
    (checkpoint / "manifest.json").write_text("{not json")
    line = in_process_fails(capsys, *train, f"model.init_from={checkpoint}", code=2)
    assert line.startswith(f"meshlm: error: model.init_from: {checkpoint}: not a readable meshlm checkpoint"), line


def test_import_never_replaces_a_model_unasked_and_takes_a_short_context(saved, tmp_path, capsys):
    """`meshlm import` into a run directory that holds a model (final/ or checkpoints) would replace
    it, or shadow its checkpoints for generate: refused naming --out unless --force. A source
    whose context is shorter than the default train.seq_len imports (nothing is trained), and
    errors about the source name --hf, the flag the user gave."""
    run_dir, checkpoint, _ = saved("single-untied")
    assert meshlm_main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["max_position_embeddings"] = 64  # below the default train.seq_len of 128
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert meshlm_main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    final = (tmp_path / "run" / "final" / "model.safetensors").read_bytes()
    deeper = tmp_path / "runs" / "of" / "imports"  # --out's missing parents are made
    assert meshlm_main(["import", "--hf", str(tmp_path / "hf"), "--out", str(deeper)]) == 0
    assert (deeper / "final" / "model.safetensors").read_bytes() == final
    for out in (tmp_path / "run", run_dir):  # an earlier import; a training run with checkpoints
        line = in_process_fails(capsys, "import", "--hf", str(tmp_path / "hf"), "--out", str(out), code=2)
        assert line.startswith(f"meshlm: error: --out: {out} already holds a model") and "--force" in line
    assert not (run_dir / "final").exists()
    assert meshlm_main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--force"]) == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").read_bytes() == final
    # --force over a training run: its checkpoints move aside, or `export RUN_DIR` (newest checkpoint
    # first) and a resuming `train` would still take the model the import replaced
    import shutil

    from safetensors.torch import load_file, save_file

    trained, other = shutil.copytree(run_dir, tmp_path / "trained"), shutil.copytree(tmp_path / "hf", tmp_path / "other")
    weights = {k: v + 1 for k, v in load_file(other / "model.safetensors").items()}  # another model than the run's
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert meshlm_main(["import", "--hf", str(other), "--out", str(trained), "--force"]) == 0
    (aside,) = trained.glob("checkpoints.old-*")
    assert f"moved the checkpoints it replaces to {aside}" in capsys.readouterr().out
    assert meshlm_main(["import", "--hf", str(other), "--out", str(trained), "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"source": str(other), "out": str(trained / "final"),
                                                   "moved_checkpoints": None}  # nothing left to move
    assert not (trained / "checkpoints").exists() and list(aside.glob("step_*"))
    assert meshlm_main(["export", "--checkpoint", str(trained), "--out", str(tmp_path / "again")]) == 0
    imported, exported = load_file(other / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert imported.keys() == exported.keys() and all(torch.equal(imported[k], exported[k]) for k in imported)
    # a train running in that directory (its lock held): refused, nothing replaced or moved
    from meshlm.train.run_lock import run_dir_lock

    before = (trained / "final" / "model.safetensors").read_bytes()
    with run_dir_lock(trained):
        line = in_process_fails(capsys, "import", "--hf", str(tmp_path / "hf"), "--out", str(trained), "--force",
                                code=2)
    assert line.startswith(f"meshlm: error: --out: {trained} is in use by another meshlm train")
    assert (trained / "final" / "model.safetensors").read_bytes() == before
    (tmp_path / "afile").write_text("")
    line = in_process_fails(capsys, "import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "afile" / "x"), code=2)
    assert line.startswith(f"meshlm: error: --out: {tmp_path / 'afile' / 'x'} cannot be made")  # was a traceback
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    line = in_process_fails(capsys, "import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "new"), code=2)
    assert line.startswith("meshlm: error: --hf: ")


def test_an_import_keeps_a_chat_template_file_for_its_export(saved, tmp_path):
    """transformers >= 4.50 saves a chat template as chat_template.jinja beside tokenizer.json:
    `meshlm import` then `meshlm export` keeps it (in tokenizer_config.json)."""
    _, checkpoint, _ = saved("single-untied")
    export_hf(checkpoint, tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert meshlm_main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    export_hf(tmp_path / "run", tmp_path / "again")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    assert hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"


def test_an_import_that_cannot_write_is_one_line_exit_1(saved, tmp_path, capsys, monkeypatch):
    """A permission or a full disk while `meshlm import` writes final/ is a runtime failure in one
    line, as for export (it was a traceback)."""
    import meshlm.train.weights as weights

    _, checkpoint, _ = saved("single-untied")
    assert meshlm_main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "run" / "final.tmp"))

    monkeypatch.setattr(weights, "save_final", no_space)
    line = in_process_fails(capsys, "import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), code=1)
    assert "No space left on device" in line
