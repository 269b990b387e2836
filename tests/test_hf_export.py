"""Hugging Face export: `meshlm export` of checkpoints saved under any layout (and of a final/)
loads in transformers with the same weights, logits, greedy text and tokens; what `meshlm
generate` loads from a checkpoint, a final/ or a run directory; bad sources and outputs are one
line (exit 2, 1 for a corrupt checkpoint)."""

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from meshlm.cli import main as meshlm_main
from meshlm.config import ConfigError
from meshlm.model import Llama
from meshlm.train.checkpoint.hf import hf_name
from meshlm.train.checkpoint.hf_export import EXPORTED, export_hf
from meshlm.train.tokenizer import encode, load_tokenizer

from helpers import run_meshlm, small_cfg
from hf_saved import SAVED, in_process_fails, meshlm_fails, small_args

transformers = pytest.importorskip("transformers")


TEXT = "ROMEO: But , soft ! what light through yonder window breaks ?\n\n  It is the east — é ü 😀 <|endoftext|> ."


def meshlm_model(model_cfg, weights) -> Llama:
    model = Llama(model_cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}
    return model.eval()


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


def test_final_is_on_disk_before_its_name_says_it_exists(corpus, saved, tmp_path, monkeypatch):
    """final/ (what generate and export prefer) is written as a checkpoint is: every file and the
    temp directory fsynced before the rename, the run directory after it. A rename alone could
    leave final/ naming files of zeros after a power loss (and a second save replaces the first)."""
    import os

    from meshlm.train.weights import save_final

    run_dir, checkpoint, full = saved("single-tied")
    cfg = small_cfg(corpus, run_dir, 1, *SAVED["single-tied"][1])
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    for _ in range(2):
        events.clear()
        save_final(full, cfg, checkpoint / "tokenizer.json", tmp_path)
        final, tmp = tmp_path / "final", str(tmp_path / "final.tmp")
        into_final = events.index(("replace", tmp, str(final)))
        synced_before = {path for kind, path, *_ in events[:into_final] if kind == "fsync"}
        assert {str(tmp_path / "final.tmp" / p.name) for p in final.iterdir()} | {tmp} <= synced_before, events
        assert ("fsync", str(tmp_path)) in events[into_final:], events


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


def test_an_export_whose_checkpoint_vanishes_before_it_opens_leaves_no_copy_behind(saved, tmp_path, monkeypatch):
    """The tokenizer files are copied aside before the checkpoint is opened (a train may delete it):
    a checkpoint gone by then is looked for again, and each failed try's copy is removed at once,
    not left in the temporary directory for the garbage collector."""
    import gc
    import tempfile
    import warnings

    from meshlm.train.checkpoint import store

    tmp_root = tmp_path / "tmp"
    tmp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_root))
    import shutil

    run_dir = shutil.copytree(saved("single-tied")[0], tmp_path / "run")
    real_init, calls = store.CheckpointReader.__init__, []

    def rotated_before_open(self, path):  # the train saves step 2 and deletes step 1 just then
        calls.append(path)
        if len(calls) == 1:
            shutil.copytree(path, path.with_name("step_0000002"))
            shutil.rmtree(path)
            raise FileNotFoundError(2, "No such file or directory", str(path / "rank0.safetensors"))
        real_init(self, path)

    monkeypatch.setattr(store.CheckpointReader, "__init__", rotated_before_open)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(run_dir, tmp_path / "out")
        gc.collect()
    # tempfile's "Implicitly cleaning up": a copy left to the garbage collector
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert [p.name for p in calls] == ["step_0000001", "step_0000002"]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert list(tmp_root.glob("meshlm-held-*")) == []


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
