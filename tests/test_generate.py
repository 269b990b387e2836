"""`meshlm generate`'s sampler on a scripted model: top-p (nucleus) keeps what Hugging Face's
does, and --stop-at-eos ends at the run's end-of-text token."""

from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from meshlm.cli import main as meshlm_main
from meshlm.train.generate import filter_logits, sample

transformers = pytest.importorskip("transformers")


def test_top_p_keeps_the_nucleus_as_hugging_face_does():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    for top_p in (0.3, 0.5, 0.79, 0.8, 0.81, 0.95, 0.999):
        ours = filter_logits(logits, top_p=top_p)
        theirs = transformers.TopPLogitsWarper(top_p)(None, logits.view(1, -1))[0]
        assert torch.equal(ours.isfinite(), theirs.isfinite()), top_p
    assert filter_logits(logits, top_p=0.5).isfinite().tolist() == [False, True, False, False]  # the top one stays
    assert filter_logits(logits, top_p=0.81).isfinite().tolist() == [False, True, True, True]
    assert torch.equal(filter_logits(logits, top_p=1.0), logits)
    # top-k first, then the nucleus of what is left (renormalised): 0.5 / 0.8 < 0.7 keeps both
    assert filter_logits(logits, top_k=2, top_p=0.7).isfinite().tolist() == [False, True, False, True]


class Scripted(torch.nn.Module):
    """Logits that make `script[i]` the certain i-th new token, then token 1 forever."""

    def __init__(self, script: list[int], n_prompt: int, vocab: int = 10):
        super().__init__()
        self.script, self.n_prompt, self.vocab = script, n_prompt, vocab
        self.cfg = SimpleNamespace(max_seq_len=64)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tokens):
        logits = torch.zeros(1, tokens.shape[1], self.vocab)
        i = tokens.shape[1] - self.n_prompt
        logits[0, -1, self.script[i] if i < len(self.script) else 1] = 50.0
        return logits


def words():
    tok = Tokenizer(WordLevel({"!": 0, "the": 1, "cat": 2, "sat": 3, "<|endoftext|>": 7, "<|eot_id|>": 8},
                              unk_token="!"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<|endoftext|>", "<|eot_id|>"])
    return tok


def test_stop_at_eos_ends_at_the_runs_end_of_text_token():
    tok = words()
    model = Scripted([2, 3, 8, 2, 3], n_prompt=1)
    ids = lambda text: tok.encode(text).ids  # noqa: E731
    # by default it goes on into the next document (the end token is invisible in the text)
    assert ids(sample(model, tok, "the", max_new_tokens=5, temperature=0, end_id=8)) == [1, 2, 3, 2, 3]
    assert ids(sample(model, tok, "the", max_new_tokens=5, temperature=0, end_id=8, stop_at_end=True)) == [1, 2, 3]
    assert ids(sample(model, tok, "the", max_new_tokens=5, temperature=0.5, end_id=8, stop_at_end=True)) == [1, 2, 3]
    # without the run's end id, the tokenizer's first known end-of-text name (7 here) ends it
    assert ids(sample(model, tok, "the", max_new_tokens=5, temperature=0, stop_at_end=True)) == [1, 2, 3, 2, 3]


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
    """A vocab_size padded past the tokenizer (its 9 ids, the model's 12): those rows stand for no
    text. Drawn, they printed nothing and fed the model an embedding it never trained on."""
    tok = words()
    model = Scripted([11, 10, 2], n_prompt=1, vocab=12)
    assert tok.encode(sample(model, tok, "the", max_new_tokens=3, temperature=0)).ids[:2] == [1, 0]

    class PaddedFirst(Scripted):  # the padded id 11 most likely, "sat" next
        def forward(self, tokens):
            logits = torch.zeros(1, tokens.shape[1], 12)
            logits[0, -1, 11], logits[0, -1, 3] = 50.0, 40.0
            return logits

    for temperature in (0, 1.0):
        out = sample(PaddedFirst([], 1, 12), tok, "the", max_new_tokens=3, temperature=temperature, top_k=None)
        assert out == "the sat sat sat", out


@pytest.mark.parametrize("top_p", ["0", "1.5", "nan", "-0.1"])
def test_a_bad_top_p_is_one_line_exit_2(tmp_path, capsys, top_p):
    assert meshlm_main(["generate", "--checkpoint", str(tmp_path), "--top-p", top_p]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlm: error: --top-p: must be in (0, 1]")


@pytest.mark.parametrize("device,reason", [("gpu", "is not a device"), ("meta", "runs on cpu or cuda"),
                                           ("cuda:7", "no such CUDA device here")])
def test_a_bad_device_is_one_line_exit_2(tmp_path, capsys, device, reason):
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert meshlm_main(["generate", "--checkpoint", str(tmp_path), "--device", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"meshlm: error: --device: ") and reason in err[0], err


def test_generate_on_a_device(single_cli_run, capsys):
    """--device cpu (and cuda where there is one) runs the model there: the same greedy text."""
    run_dir, _ = single_cli_run
    texts = []
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        capsys.readouterr()
        assert meshlm_main(["generate", "--checkpoint", str(run_dir), "--prompt", "The ", "--max-new-tokens", "6",
                            "--temperature", "0", "--device", device]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("The ") and len(set(texts)) == 1


def test_generate_warns_when_final_is_older_than_a_checkpoint(corpus, tmp_path, capsys):
    """A finished run (final/ at step 2), resumed for 4 steps, failing at step 4 after its step-3
    checkpoint: generate of the run directory still takes final/ (documented), but says that a
    later checkpoint exists, which export of the same directory takes. A finished run: no warning."""
    from helpers import meshlm_in_process, small_train_args

    run_dir = tmp_path / "run"
    args = [*small_train_args(corpus, run_dir, steps=2), "checkpoint.interval=1", "run.sample_tokens=0"]
    meshlm_in_process("train", *args)
    generate = ["generate", "--checkpoint", str(run_dir), "--max-new-tokens", "2"]
    capsys.readouterr()
    assert meshlm_main(generate) == 0 and "warning" not in capsys.readouterr().err
    meshlm_in_process("train", *args, "train.steps=4", "debug.fault=raise", "debug.fault_step=4", code=None)
    assert (run_dir / "checkpoints" / "step_0000003").is_dir()
    capsys.readouterr()
    assert meshlm_main(generate) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"meshlm: warning: using {run_dir / 'final'} (step 2), but checkpoint "
                   f"{run_dir / 'checkpoints' / 'step_0000003'} was written after it; pass --checkpoint "
                   f"{run_dir / 'checkpoints' / 'step_0000003'} to use that one"]


def test_generate_outlives_a_running_train_rotating_its_checkpoint_away(corpus, tmp_path, capsys, monkeypatch):
    """`meshlm generate --checkpoint RUN_DIR` while a train runs there (no final/ yet: the newest
    checkpoint): the train's next save deletes it (checkpoint.keep=1; measured, a save per step: 5
    of 6 calls failed): deleted once open, the tokenizer read last was gone (a traceback, or
    "data.tokenizer: ... does not exist", exit 2, an option never passed); deleted while being
    verified, "no usable checkpoint" beside a newer one. As export: the small files are copied
    and the rank files mapped first, and a checkpoint deleted before it was open is looked for again."""
    import shutil

    from helpers import meshlm_in_process, small_train_args
    from meshlm.train.checkpoint import store

    run_dir = tmp_path / "run"
    meshlm_in_process("train", *small_train_args(corpus, run_dir, steps=1), "checkpoint.interval=1",
                      "run.sample_tokens=0")
    shutil.rmtree(run_dir / "final")  # a train still running: its newest checkpoint is the model

    def generate(source):
        capsys.readouterr()
        code = meshlm_main(["generate", "--checkpoint", str(source), "--prompt", "The ", "--max-new-tokens", "6",
                            "--temperature", "0"])
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out

    expected = generate(run_dir)
    opened = shutil.copytree(run_dir, tmp_path / "opened")  # deleted right after it was opened
    real_init = store.CheckpointReader.__init__

    def rotated_once_open(self, path):
        real_init(self, path)
        shutil.rmtree(path)

    monkeypatch.setattr(store.CheckpointReader, "__init__", rotated_once_open)
    assert generate(opened) == expected
    monkeypatch.undo()
    assert not (opened / "checkpoints" / "step_0000001").exists()

    found = shutil.copytree(run_dir, tmp_path / "found")  # replaced by a newer one while being verified
    real_verify, rotations = store.verify, []

    def rotated_while_verified(path, *args):
        if not rotations:
            rotations.append(path)
            shutil.copytree(path, path.with_name("step_0000002"))
            shutil.rmtree(path)
        return real_verify(path, *args)

    monkeypatch.setattr(store, "verify", rotated_while_verified)
    assert generate(found) == expected and rotations


def test_generate_warns_when_a_resume_from_an_older_checkpoint_left_final_behind(corpus, tmp_path, capsys):
    """A finished 4-step run (final/ at step 4), resumed from its step-2 checkpoint (the newer ones
    set aside: docs/checkpointing.md), failing at step 4 after its step-3 checkpoint: export of the
    run directory takes that step-3 checkpoint, final/ holds the other timeline's step 4, so
    generate warns as when a run resumed with more steps stopped early."""
    from helpers import meshlm_in_process, small_train_args
    from meshlm.train.weights import find_trained

    run_dir = tmp_path / "run"
    args = [*small_train_args(corpus, run_dir, steps=4), "checkpoint.interval=1", "checkpoint.keep=4",
            "run.sample_tokens=0"]
    meshlm_in_process("train", *args)
    older = run_dir / "checkpoints" / "step_0000002"
    meshlm_in_process("train", *args, f"checkpoint.resume={older}", "debug.fault=raise", "debug.fault_step=4",
                      code=None)
    newest = run_dir / "checkpoints" / "step_0000003"
    assert newest.is_dir() and not (run_dir / "checkpoints" / "step_0000004").exists()
    assert find_trained(run_dir, prefer="checkpoint") == ("checkpoint", newest)  # what export takes
    capsys.readouterr()
    assert meshlm_main(["generate", "--checkpoint", str(run_dir), "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"meshlm: warning: using {run_dir / 'final'} (step 4), but checkpoint {newest} was written "
                   f"after it; pass --checkpoint {newest} to use that one"]


def test_no_warning_when_final_was_written_after_the_newest_checkpoint_of_another_step(corpus, tmp_path, capsys):
    """A run that failed at step 3 after its step-2 checkpoint, resumed to its end with no more
    checkpoints (checkpoint.interval=0): final/ (step 3) is newer than every checkpoint, though none
    is at its step, so generate of the run directory takes it without a warning."""
    from helpers import meshlm_in_process, small_train_args

    run_dir = tmp_path / "run"
    args = [*small_train_args(corpus, run_dir, steps=3), "run.sample_tokens=0"]
    meshlm_in_process("train", *args, "checkpoint.interval=1", "debug.fault=raise", "debug.fault_step=3", code=None)
    meshlm_in_process("train", *args, "checkpoint.interval=0")
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_0000001", "step_0000002"]
    assert (run_dir / "final").is_dir()
    capsys.readouterr()
    assert meshlm_main(["generate", "--checkpoint", str(run_dir), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err == ""
