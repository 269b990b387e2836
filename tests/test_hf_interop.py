"""Hugging Face interop: `meshlm export` of checkpoints saved under any layout loads in
transformers with the same weights, logits, greedy text and tokens; `model.init_from` of a
transformers Llama (or of an export, or of a checkpoint) gives every layout the same weights;
bad paths and bad configs are one line and exit 2 (1 for a corrupt checkpoint)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshlm.cli import main as meshlm_main
from meshlm.config import ConfigError
from meshlm.model import Llama, init_weights
from meshlm.testing import run_ranks
from meshlm.train.checkpoint import save_checkpoint
from meshlm.train.checkpoint.hf import hf_name
from meshlm.train.checkpoint.hf_import import init_from
from meshlm.train.checkpoint.hf_export import EXPORTED, export_hf
from meshlm.train.tokenizer import encode, load_tokenizer

from helpers import build_trainer, read_metrics, run_meshlm, small_cfg

transformers = pytest.importorskip("transformers")

SAVED = {  # layout -> (world size, overrides): sharded by dp (ZeRO-3), tp and pp, and one process
    "single-untied": (1, ["model.tie_embeddings=false"]),
    "single-tied": (1, ["model.tie_embeddings=true"]),
    "dp2-zero3": (2, ["model.tie_embeddings=false", "parallel.zero=3"]),
    "tp2": (2, ["model.tie_embeddings=false", "parallel.tp=2"]),
    "pp2-tied": (2, ["model.tie_embeddings=true", "parallel.pp=2"]),
    "cp2": (2, ["model.tie_embeddings=false", "parallel.cp=2"]),
}
TEXT = "ROMEO: But , soft ! what light through yonder window breaks ?\n\n  It is the east — é ü 😀 <|endoftext|> ."


class FullTensors:
    """A reader (as load_weights takes) over full tensors held in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, kind, name, rect, out):
        full = self.tensors[name]
        full = full.view(1, -1) if full.ndim == 1 else full
        out.copy_(full[rect.row: rect.row + rect.rows, rect.col: rect.col + rect.cols])


def scaled_weights(model_cfg, seed: int = 3) -> dict[str, torch.Tensor]:
    """meshlm's initialisation x5 and norm weights in [0.5, 1.5]: logits far from uniform, so a
    wrong name, transpose or config field shows up in them (std 0.02 weights would hide it)."""
    model = Llama(model_cfg)
    init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        out[name] = (torch.rand(p.shape, generator=gen) + 0.5) if name.endswith("norm.weight") else p.detach() * 5
    return out


def save_scaled(corpus, run_dir, world_size, extra):
    """Load the scaled weights into a trainer of this layout, train one step, save a checkpoint.
    Returns (full weights after the step, on rank 0; rank)."""
    trainer = build_trainer(small_cfg(corpus, run_dir, world_size, *extra, steps=2))
    from meshlm.train.checkpoint.state import load_weights

    load_weights(trainer, FullTensors(scaled_weights(trainer.cfg.model)), optimizer_state=False)
    trainer.train_step()
    full = {k: v.detach().clone() for k, v in trainer.full_state_dict().items()}
    save_checkpoint(trainer, run_dir / "checkpoints", keep=2)
    return full, trainer.ctx.rank


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """layout -> (run dir, its checkpoint dir, full weights): made on first use."""
    made = {}

    def get(layout):
        if layout not in made:
            world, extra = SAVED[layout]
            run_dir = tmp_path_factory.mktemp(layout)
            args = (corpus, run_dir, world, extra)
            results = [save_scaled(*args)] if world == 1 else run_ranks(save_scaled, world, *args, timeout=120)
            made[layout] = (run_dir, run_dir / "checkpoints" / "step_0000001", results[0][0])
        return made[layout]

    return get


def meshlm_model(model_cfg, weights) -> Llama:
    model = Llama(model_cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}
    return model.eval()


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("layout", list(SAVED))
def test_export_loads_in_transformers_with_same_weights_and_logits(corpus, saved, tmp_path, layout):
    run_dir, checkpoint, full = saved(layout)
    report = export_hf(run_dir, tmp_path / "hf")  # a run directory: its newest good checkpoint
    assert report.source == checkpoint and report.step == 1
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model_cfg = small_cfg(corpus, run_dir, 1, SAVED[layout][1][0]).model  # the tie setting
    tied = model_cfg.tie_embeddings
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    theirs = hf.state_dict()
    assert set(theirs) == {hf_name(k) for k in full} | ({"lm_head.weight"} if tied else set())
    for name, value in full.items():  # the weights the sharded run held, bit for bit
        assert torch.equal(theirs[hf_name(name)], value), name
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 24))
    with torch.no_grad():
        ours, hf_logits = meshlm_model(model_cfg, full)(tokens), hf(input_ids=tokens).logits
    assert ours.abs().max() > 1.0  # not near-uniform logits, where an error could hide
    assert (ours - hf_logits).abs().max() <= 1e-4


def test_exported_tokenizer_encodes_like_meshlm(saved, tmp_path):
    _, checkpoint, _ = saved("single-tied")
    export_hf(checkpoint, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = load_tokenizer(checkpoint / "tokenizer.json")
    assert hf_tok(TEXT)["input_ids"] == encode(ours, TEXT)
    assert hf_tok.decode(encode(ours, TEXT)) == TEXT  # byte-level: exact round trip, no space cleanup
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == ours.token_to_id("<|endoftext|>")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"


def test_export_in_bfloat16(saved, tmp_path):
    """--dtype bfloat16: half the bytes, the weights rounded to nearest, a config.json that loads them
    as bf16; float32 stays the default (the masters as they are)."""
    _, checkpoint, full = saved("single-tied")
    fp32 = export_hf(checkpoint, tmp_path / "fp32")
    assert meshlm_main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "bf16"),
                        "--dtype", "bfloat16"]) == 0
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert abs((tmp_path / "bf16" / "model.safetensors").stat().st_size * 2 - fp32.bytes) < 4096
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf.dtype == torch.bfloat16
    theirs = hf.state_dict()
    for name, value in full.items():
        assert torch.equal(theirs[hf_name(name)], value.to(torch.bfloat16)), name


def test_an_export_makes_the_parents_of_its_out_and_reports_the_seconds_it_took(saved, tmp_path):
    _, checkpoint, _ = saved("single-tied")
    out = tmp_path / "exports" / "of" / "run"
    start = time.perf_counter()
    report = export_hf(checkpoint, out)
    wall = time.perf_counter() - start
    assert 0 < report.seconds <= wall and report.out == out
    assert transformers.LlamaForCausalLM.from_pretrained(out).config.tie_word_embeddings is True


def test_export_of_a_final_directory(corpus, saved, tmp_path):
    """final/ (save_final keeps one name of a tied pair, the checkpoint none) exports the same."""
    from meshlm.train.weights import save_final

    run_dir, checkpoint, full = saved("single-tied")
    cfg = small_cfg(corpus, run_dir, 1, *SAVED["single-tied"][1])
    save_final(full, cfg, checkpoint / "tokenizer.json", tmp_path)
    export_hf(tmp_path / "final", tmp_path / "from-final")
    export_hf(checkpoint, tmp_path / "from-checkpoint")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "from-final" / name).read_bytes() == (tmp_path / "from-checkpoint" / name).read_bytes()


def test_an_export_outlives_a_running_train_rotating_its_checkpoint_away(saved, tmp_path, monkeypatch):
    """`meshlm export RUN_DIR` while a train runs there: the train's next save deletes the
    checkpoint being exported (checkpoint.keep=1). Deleted once the export had opened it, the export
    died with a traceback ("Exception: No such file or directory", from the tokenizer, read last);
    deleted between being found and being opened, "no usable checkpoint" (exit 1) though the train
    had just written a newer one. Now what the export opened is read to the end, and a checkpoint
    gone before it was open is looked for again."""
    import shutil

    from meshlm.train.checkpoint import store

    run_dir, checkpoint, _ = saved("single-tied")
    export_hf(checkpoint, tmp_path / "intact")

    def same_export(out):
        for name in EXPORTED:
            assert (out / name).read_bytes() == (tmp_path / "intact" / name).read_bytes(), name

    opened = shutil.copytree(run_dir, tmp_path / "opened")  # (1) deleted right after the export opened it
    real_init = store.CheckpointReader.__init__

    def rotated_once_open(self, path):
        real_init(self, path)
        shutil.rmtree(path)

    monkeypatch.setattr(store.CheckpointReader, "__init__", rotated_once_open)
    report = export_hf(opened, tmp_path / "out-opened")
    monkeypatch.undo()
    assert report.source == opened / "checkpoints" / "step_0000001" and not report.source.exists()
    same_export(tmp_path / "out-opened")

    found = shutil.copytree(run_dir, tmp_path / "found")  # (2) replaced by a newer one while being verified
    real_verify, rotations = store.verify, []

    def rotated_while_verified(path, *args):
        if not rotations:  # the train saves step 2 (here: the same weights) and deletes step 1
            rotations.append(path)
            shutil.copytree(path, path.with_name("step_0000002"))
            shutil.rmtree(path)
        return real_verify(path, *args)

    monkeypatch.setattr(store, "verify", rotated_while_verified)
    report = export_hf(found, tmp_path / "out-found")
    assert rotations == [found / "checkpoints" / "step_0000001"]
    assert report.source == found / "checkpoints" / "step_0000002"
    same_export(tmp_path / "out-found")


@pytest.mark.parametrize("layout", list(SAVED))
def test_generate_reads_a_checkpoint_and_a_final_of_any_layout_with_its_weights(corpus, saved, tmp_path, layout):
    """What `meshlm generate` loads (weights.load_trained), from a checkpoint saved under this layout
    and from a final/ written with the same weights and this layout's config (each resolved for
    the world it trained on, dp*tp*cp*pp): the weights the sharded run held, bit for bit."""
    from meshlm.train.weights import load_trained, save_final

    run_dir, checkpoint, full = saved(layout)
    world, extra = SAVED[layout]
    cfg = small_cfg(corpus, run_dir, world, *extra)
    save_final(full, cfg, checkpoint / "tokenizer.json", tmp_path)
    for source in (checkpoint, tmp_path / "final"):
        model, _, loaded, _ = load_trained(source)
        assert dataclasses.asdict(loaded.parallel) == dataclasses.asdict(cfg.parallel), source
        state = model.state_dict()
        for name, value in full.items():
            assert torch.equal(state[name], value), (source, name)
        assert (model.output.weight is model.tok_embeddings.weight) == cfg.model.tie_embeddings


def test_a_final_directory_needs_both_its_weights_and_its_tokenizer(saved, tmp_path):
    """save_final writes model.safetensors and tokenizer.json together: a final/ with one of them
    alone (a copy cut short) is passed over for the run's newest checkpoint, and on its own it is
    no model (generate could not load it)."""
    from meshlm.train.weights import find_trained

    run_dir, checkpoint, _ = saved("single-tied")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for present in ("model.safetensors", "tokenizer.json"):
        final = copy / "final"
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir()
        source = "tokenizer.json" if present == "tokenizer.json" else "rank00000.safetensors"
        shutil.copyfile(checkpoint / source, final / present)
        assert find_trained(copy, prefer="final") == ("checkpoint", copy / "checkpoints" / checkpoint.name), present
        with pytest.raises(ConfigError, match="holds no checkpoint"):
            find_trained(final)


def test_export_of_a_run_directory_takes_its_checkpoint_and_generate_its_final(corpus, saved, tmp_path):
    """A run directory holding both: export takes the newest checkpoint (the masters and the step
    it can name), generate final/ (docs/checkpointing.md)."""
    from meshlm.train.weights import find_trained, save_final

    run_dir, checkpoint, full = saved("single-tied")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    save_final(full, small_cfg(corpus, copy, 1, *SAVED["single-tied"][1]), checkpoint / "tokenizer.json", copy)
    report = export_hf(copy, tmp_path / "hf")
    assert report.source == copy / "checkpoints" / checkpoint.name and report.step == 1
    assert find_trained(copy) == ("final", copy / "final")


def test_hf_greedy_text_equals_meshlm_generate(saved, tmp_path, capsys):
    """The CLI end to end, in this process (the commands' code without an interpreter start each;
    meshlm_fails below runs `meshlm export` in a real one): `meshlm export` of a ZeRO-3 run, and
    `meshlm generate --temperature 0` reading that run's sharded checkpoint directly."""
    _, checkpoint, _ = saved("dp2-zero3")
    proc = run_meshlm("export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf"), "--json",
                      in_process=True)
    assert json.loads(proc.stdout)["step"] == 1
    n_new = 30
    ours = run_meshlm("generate", "--checkpoint", str(checkpoint), "--prompt", "ROMEO:", "--temperature", "0",
                      "--max-new-tokens", str(n_new), in_process=True).stdout[:-1]  # print's newline
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf.generation_config.eos_token_id = None  # meshlm's sampler does not stop at end-of-text
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tok("ROMEO:", return_tensors="pt")["input_ids"]
    out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n_new)
    assert out.shape[1] == prompt.shape[1] + n_new
    assert tok.decode(out[0]) == ours
    # and back: `meshlm import` of the export generates the same text
    assert meshlm_main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert meshlm_main(["generate", "--checkpoint", str(tmp_path / "back"), "--prompt", "ROMEO:", "--temperature", "0",
                        "--max-new-tokens", str(n_new)]) == 0
    assert capsys.readouterr().out[:-1] == ours


# --------------------------------------------------------------------------- import


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


# Llama 3.2's scaling numbers on a 32-token "pretraining" context: with head_dim 16 and theta 5000,
# the wavelengths 6.3 (kept), 18.7 (blended) and 56 and up (divided by 32) cover all three bands,
# and 96 tokens run 3x past the original context.
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


def small_args(corpus, run_dir):
    from helpers import small_train_args

    return [a for a in small_train_args(corpus, run_dir) if not a.startswith(("model.", "train.steps"))]


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


# --------------------------------------------------------------------------- bad input


def meshlm_fails(*args: str, code: int) -> str:
    """`meshlm ARGS` in a subprocess; asserts exit `code` and one line on stderr, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), proc.stderr
    return lines[0]


def in_process_fails(capsys, *args: str, code: int) -> str:
    """The same through meshlm.cli.main in this process: cheaper for the many cases."""
    capsys.readouterr()
    assert meshlm_main(list(args)) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), lines
    return lines[0]


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


def test_bad_export_source_is_one_line(saved, tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    line = meshlm_fails("export", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"), code=2)
    assert "holds no checkpoint" in line
    assert "not a directory" in in_process_fails(capsys, "export", "--checkpoint", str(tmp_path / "missing"),
                                                 "--out", str(tmp_path / "x"), code=2)
    _, checkpoint, _ = saved("single-untied")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoint, corrupt)
    data = bytearray((corrupt / "rank00000.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (corrupt / "rank00000.safetensors").write_bytes(bytes(data))
    line = in_process_fails(capsys, "export", "--checkpoint", str(corrupt), "--out", str(tmp_path / "x"), code=1)
    assert "rank00000.safetensors" in line and "checksum" in line
    assert not (tmp_path / "x").exists()
    for lost in ("meta.json", "manifest.json"):  # a checkpoint lacking either file is a damaged one (exit 1)
        damaged = tmp_path / f"no-{lost}"
        shutil.copytree(checkpoint, damaged)
        (damaged / lost).unlink()
        line = in_process_fails(capsys, "export", "--checkpoint", str(damaged), "--out", str(tmp_path / "x"), code=1)
        assert lost in line, line
    # another model's directory (a config.json and its shards): never replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    line = in_process_fails(capsys, "export", "--checkpoint", str(checkpoint), "--out", str(other), code=2)
    assert "--out" in line and "model-00001-of-00002.safetensors, which no export writes" in line
    assert (other / "model-00001-of-00002.safetensors").read_bytes() == b"weights"


def test_an_export_out_under_a_file_is_bad_usage(saved, tmp_path, capsys):
    """`--out a_file/x` cannot be made: exit 2 naming --out, as `meshlm import --out` and run.dir
    say (it was exit 1 with a bare "[Errno 17] File exists: 'a_file'")."""
    _, checkpoint, _ = saved("single-untied")
    (tmp_path / "a_file").write_text("")
    line = in_process_fails(capsys, "export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "a_file" / "x"),
                            code=2)
    assert line.startswith("meshlm: error: --out: ") and "a_file is not a directory" in line, line


def test_export_into_the_working_directory(saved, tmp_path, monkeypatch):
    _, checkpoint, _ = saved("single-untied")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert meshlm_main(["export", "--checkpoint", str(checkpoint), "--out", "."]) == 0
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == sorted(EXPORTED)
    assert meshlm_main(["export", "--checkpoint", str(checkpoint), "--out", "."]) == 0  # an earlier export: replaced
    assert Path.cwd() == tmp_path / "here" and sorted(p.name for p in Path.cwd().iterdir()) == sorted(EXPORTED)
    # paths that look like numbers are paths: `meshlm import --hf 1000 --out 42`
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").rename(tmp_path / "1000")
    assert meshlm_main(["import", "--hf", "1000", "--out", "42"]) == 0
    assert (tmp_path / "42" / "final" / "model.safetensors").is_file()


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


def test_an_export_names_the_end_token_the_run_separated_documents_with(corpus, saved, tmp_path, monkeypatch):
    """A pretrained tokenizer with several end-of-text tokens (Llama-3's chat tokenizer has
    <|end_of_text|> and <|eot_id|>): its tokenizer_config.json names the one the data is separated
    with, and the export of a checkpoint or of final/ names that one as eos, not the first known name."""
    from tokenizers import Tokenizer

    _, checkpoint, _ = saved("single-untied")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))  # has meshlm's <|endoftext|>
    tokenizer.add_special_tokens(["<|eot_id|>"])
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    template = "{% for m in messages %}<|eot_id|>{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>",
                                                                        "chat_template": template}))
    eot = tokenizer.token_to_id("<|eot_id|>")
    assert eot != tokenizer.token_to_id("<|endoftext|>")
    run_dir = tmp_path / "run"
    run_meshlm("train", "model.preset=debug", "model.vocab_size=520", f"data.tokenizer={tmp_path / 'tok'}",
               *small_args(corpus, run_dir), "train.steps=1", "checkpoint.interval=1", "run.sample_tokens=0",
               in_process=True)
    for source in (run_dir / "checkpoints" / "step_0000001", run_dir / "final"):
        export_hf(source, tmp_path / f"hf-{source.name}")
        assert json.loads((tmp_path / f"hf-{source.name}" / "config.json").read_text())["eos_token_id"] == eot
        assert json.loads((tmp_path / f"hf-{source.name}" / "tokenizer_config.json").read_text())["eos_token"] \
            == "<|eot_id|>"
        # the chat template comes along (it was dropped: apply_chat_template of the export failed)
        hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / f"hf-{source.name}")
        chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert chat == "<|eot_id|>user: hi"
    # the same tokenizer.json and end token with another template: the same token cache (a hit), and
    # the run carries its own template (it got the first run's, which the cache had recorded)
    import shutil

    shutil.copytree(tmp_path / "tok", tmp_path / "tok2")
    (tmp_path / "tok2" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>",
                                                                         "chat_template": "[{{ messages[0]['content'] }}]"}))
    second = run_meshlm("train", "model.preset=debug", "model.vocab_size=520", f"data.tokenizer={tmp_path / 'tok2'}",
                        *small_args(corpus, tmp_path / "run2"), "train.steps=1", "run.sample_tokens=0", in_process=True)
    assert "(cached in" in second.stdout + second.stderr
    export_hf(tmp_path / "run2" / "final", tmp_path / "hf-run2")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf-run2")
    assert hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    # and `meshlm generate` of an empty prompt starts after that token too, not after <|endoftext|>
    import meshlm.train.generate as generate

    started = []
    original = generate.start_ids
    monkeypatch.setattr(generate, "start_ids", lambda *a, **k: started.append(original(*a, **k)) or started[-1])
    for source in (run_dir, run_dir / "checkpoints" / "step_0000001"):
        run_meshlm("generate", "--checkpoint", str(source), "--prompt", "", "--max-new-tokens", "2", in_process=True)
    assert started == [[eot], [eot]]
