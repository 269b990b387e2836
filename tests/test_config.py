"""Configuration: loading, overrides, validation, and the CLI's exit-2 contract."""

import dataclasses
import subprocess
import sys
import tomllib
import types
import typing

import pytest

from helpers import meshlm_in_process
from meshlm import cli
from meshlm.config import RANGES, Config, ConfigError, load_config, resolve
from meshlm.config_toml import to_toml, toml_value


def test_overrides_parse_types_and_presets_fill_the_rest():
    cfg = resolve(load_config(None, ["train.steps=7", "train.lr=1e-3", "train.dtype=bfloat16",
                                     "model.preset=debug", "model.dim=96", "model.n_heads=4"]))
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3 and cfg.train.dtype == "bfloat16"
    assert cfg.model.dim == 96 and cfg.model.n_layers == 2  # the rest from the debug preset


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = resolve(load_config(None, ["train.steps=5", "run.sample_prompt=say \"hi\""]))
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert resolve(load_config(str(path))) == cfg
    # a prompt from a TOML file may hold any character: newlines, tabs, control characters, a backslash
    cfg.run.sample_prompt = "First Citizen:\nBefore\twe \\ proceed\x01\x7f é"
    path.write_text(to_toml(cfg))
    assert load_config(str(path)).run.sample_prompt == cfg.run.sample_prompt


def test_dp_is_inferred_from_the_world_size():
    cfg = resolve(load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=16"]), world_size=4)
    assert cfg.parallel.dp == 4


@pytest.mark.parametrize("overrides, key", [
    (["train.nosuchkey=1"], "train.nosuchkey"),
    (["nosection.x=1"], "nosection.x"),
    (["train.steps=abc"], "train.steps"),
    (["train.steps=1.5"], "train.steps"),
    (["train.lr=fast"], "train.lr"),
    (["train.steps=0"], "train.steps"),
    (["parallel.zero=9"], "parallel.zero"),
    (["parallel.pp_schedule=zigzag"], "parallel.pp_schedule"),
    (["train.dtype=float16"], "train.dtype"),
    (["train.recompute=some"], "train.recompute"),
    (["model.preset=gpt5"], "model.preset"),
    (["model.n_heads=5"], "model.dim"),
    (["model.n_kv_heads=4"], "model.n_kv_heads"),
    (["train.global_batch_size=30", "train.micro_batch_size=16"], "train.global_batch_size"),
    (["parallel.pp_microbatches=2", "train.micro_batch_size=3"], "train.global_batch_size"),  # pp=1: count unused
    (["train.seq_len=99999"], "train.seq_len"),
    (["parallel.dp=3"], "parallel"),
    (["data.path=/no/such/file"], "data.path"),
    (["parallel.pp_layers=3,1"], "parallel.pp_layers"),  # pp=1: one stage, two counts
    (["parallel.pp_layers=four"], "parallel.pp_layers"),
    (["parallel.pp_schedule=interleaved", "parallel.pp_virtual=2"], "parallel.pp_virtual"),  # pp=1: no stages
])
def test_bad_values_raise_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, overrides))
    assert key in str(err.value) and "\n" not in str(err.value)


def test_checks_that_relate_keys_to_each_other_and_to_the_world():
    def refused(overrides, world_size=1):
        with pytest.raises(ConfigError) as err:
            resolve(load_config(None, overrides), world_size=world_size)
        return str(err.value)

    assert refused(["model.dim=36", "model.n_heads=4", "model.n_kv_heads=2"]).startswith("model.dim: head dim 9")
    layout = ["parallel.dp=2", "parallel.tp=2", "train.global_batch_size=16"]
    assert resolve(load_config(None, layout), world_size=4).parallel.dp == 2
    assert "2*2*1*1 = 4 does not equal the world size 2" in refused(layout, world_size=2)
    inferred = resolve(load_config(None, ["parallel.tp=2", "parallel.cp=2", "train.micro_batch_size=8"]), world_size=8)
    assert inferred.parallel.dp == 2  # world 8 / (tp 2 * cp 2)
    assert refused(["debug.fault_rank=2"], world_size=2) == "debug.fault_rank: must be in 0..1, got 2"
    assert refused(["debug.fault_rank=3"], world_size=2) == "debug.fault_rank: must be in 0..1, got 3"
    assert refused(["model.vocab_size=259"]).startswith("model.vocab_size: 259 is too small for a byte-level BPE")
    assert resolve(load_config(None, ["model.vocab_size=260"])).model.vocab_size == 260
    assert resolve(load_config(None, ["train.seq_len=1024"])).train.seq_len == 1024  # = the tiny preset's max
    assert resolve(load_config(None, ["parallel.pp_microbatches=3"])).parallel.pp == 1  # no pipeline: unused
    for key in ("train", "train.steps.max"):
        with pytest.raises(ConfigError, match="keys have the form section.name"):
            load_config(None, [f"{key}=3"])
    assert "does not equal the world size 2" in refused(["parallel.dp=1"], world_size=2)  # too few, not only too many
    assert refused(["train.micro_batch_size=4", "train.global_batch_size=4"], world_size=2).startswith(
        "train.global_batch_size: 4 is not divisible by micro_batch_size*dp = 4*2")
    assert resolve(load_config(None, [])).parallel.dp == 1  # resolve() alone: one process
    assert resolve(load_config(None, ["parallel.tp=2", "parallel.sp=true"]), world_size=2).parallel.sp
    assert resolve(load_config(None, ["model.n_kv_heads=6"])).model.n_kv_heads == 6  # as many as n_heads: MHA
    assert refused(["parallel.sp=true"]).startswith("parallel.sp=true: sequence parallelism shards along tp")
    with pytest.raises(ConfigError, match="overrides have the form section.key=value"):
        load_config(None, ["train.steps"])
    for override, message in (("train.steps=abc", "train.steps: expected an integer, got 'abc'"),
                              ("model.tie_embeddings=3", "model.tie_embeddings: expected true/false, got 3")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert str(err.value) == message


def test_a_pretrained_tokenizer_must_fit_the_embedding_exactly_or_with_room(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["to be or not to be"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    n_ids = tokenizer.get_vocab_size()
    fits = ["model.preset=debug", f"data.tokenizer={tmp_path}"]
    assert resolve(load_config(None, [*fits, f"model.vocab_size={n_ids}"])).model.vocab_size == n_ids
    with pytest.raises(ConfigError, match=f"model.vocab_size: {n_ids - 1} is smaller than the vocabulary"):
        resolve(load_config(None, [*fits, f"model.vocab_size={n_ids - 1}"]))


def test_an_explicit_pipeline_split_must_cover_every_layer_once():
    base = ["model.n_layers=4", "parallel.pp=2", "train.micro_batch_size=4", "train.global_batch_size=16"]
    assert resolve(load_config(None, [*base, "parallel.pp_layers=3,1"]), world_size=2).parallel.pp_layers == "3,1"
    for bad in ("3,2", "5,-1", "4", "2,1,1", "2,1"):  # the sum, a negative, too few, too many, too few layers
        with pytest.raises(ConfigError, match="parallel.pp_layers"):
            resolve(load_config(None, [*base, f"parallel.pp_layers={bad}"]), world_size=2)
    # Without a split the layers must divide evenly; with one they need not.
    with pytest.raises(ConfigError, match="parallel.pp_layers"):
        resolve(load_config(None, [*base, "model.n_layers=3"]), world_size=2)
    resolve(load_config(None, [*base, "model.n_layers=3", "parallel.pp_layers=2,1"]), world_size=2)


LLAMA3 = ["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
          "model.rope_high_freq_factor=4", "model.rope_original_max_seq_len=128"]


def test_llama3_rope_scaling_takes_all_four_numbers_or_none():
    cfg = resolve(load_config(None, LLAMA3))
    assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_original_max_seq_len) == ("llama3", 8.0, 128)
    assert resolve(load_config(None, [f"model.{k}={v}" for k, v in tomllib.loads(to_toml(cfg))["model"].items()
                                      if k.startswith("rope_")])).model == cfg.model  # config.toml keeps them
    assert resolve(load_config(None, [])).model.rope_scaling == "none"

    def refused(overrides) -> str:
        with pytest.raises(ConfigError) as err:
            resolve(load_config(None, overrides))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert refused(LLAMA3[:1] + LLAMA3[2:]).startswith("model.rope_factor: required with model.rope_scaling=llama3")
    assert refused(LLAMA3[:-1]).startswith("model.rope_original_max_seq_len: required")
    assert refused(["model.rope_factor=8"]).startswith("model.rope_factor: 8.0 is set, but model.rope_scaling is none")
    assert refused(["model.rope_scaling=none", "model.rope_high_freq_factor=4"]).startswith(
        "model.rope_high_freq_factor: 4.0 is set")
    assert refused(LLAMA3[:3] + ["model.rope_high_freq_factor=1", LLAMA3[4]]).startswith(
        "model.rope_high_freq_factor: 1.0 must exceed model.rope_low_freq_factor=1.0")
    assert refused(["model.rope_scaling=linear"]).startswith("model.rope_scaling: must be one of none, llama3")


def test_bad_toml_file_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nsteps = 3\nlr = = 2\n")
    with pytest.raises(ConfigError, match=r"bad.toml.*line 3"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"))


def test_run_and_cache_directories_that_are_files_are_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    for key in ("run.dir", "data.cache_dir"):
        with pytest.raises(ConfigError, match=f"^{key}: .*afile exists and is not a directory"):
            resolve(load_config(None, [f"{key}={tmp_path / 'afile'}"]))
        with pytest.raises(ConfigError, match=f"^{key}: .*afile/x/y cannot be made: .*afile is not a directory"):
            resolve(load_config(None, [f"{key}={tmp_path / 'afile' / 'x' / 'y'}"]))  # was a traceback at mkdir
    assert resolve(load_config(None, [f"run.dir={tmp_path / 'new' / 'run'}"])).run.dir  # to be made: fine
    monkeypatch.setenv("HOME", str(tmp_path))  # data.path with ~, as the corpus reader reads it
    (tmp_path / "corpus.txt").write_text("some text\n")
    assert resolve(load_config(None, ["data.path=~/corpus.txt"])).data.path == "~/corpus.txt"


def _meshlm(*args):
    return subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, key", [
    (["train", "train.nosuchkey=1"], "train.nosuchkey"),
    (["train", "train.steps=abc"], "train.steps"),
    (["train", "parallel.zero=9"], "parallel.zero"),
    (["train", "--nproc", "2", "parallel.dp=1"], "world size"),
    (["train", "train.steps=3", "--nproc", "2", "parallel.dp=1"], "world size"),  # an override after an option
    (["generate", "--checkpoint", "/no/such/dir"], "--checkpoint"),
    (["train", "--nnodes", "0"], "--nnodes"),
    (["generate", "--checkpoint", "/no/such/dir", "--temperature", "nan"], "--temperature"),
    (["generate", "--checkpoint", "/no/such/dir", "--seed", str(2**70)], "--seed"),
    # argparse's own refusals: one line too, not the usage block before it
    (["train", "--nproc", "x"], "--nproc"),
    (["generate", "--checkpoint", "/no/such/dir", "--top-k", "abc"], "--top-k"),
    (["nosuchcommand"], "nosuchcommand"),
    (["bench", "gpu", "--steps", "x"], "--steps"),
    (["simulate", "pipeline", "--pp", "x"], "--pp"),
    (["bench", "data", "--pairs", "x"], "--pairs"),
    (["bench", "comm", "--sizes", "x"], "--sizes"),  # its own check after argparse's
    (["bench", "dp", "--steps", "x"], "--steps"),
    (["memory", "--nproc", "8"], "meshlm memory --help"),  # an option of another command: its own help named
])
def test_cli_exits_2_with_one_line_and_no_traceback(args, key, tmp_path):
    """Through meshlm.cli.main in this process (what `python -m meshlm.cli` runs; an exception that
    escaped it would fail the test here too), and the first case also through a real process."""
    args = [*args, *([f"run.dir={tmp_path}"] if args[0] == "train" else [])]
    procs = [meshlm_in_process(*args, code=None), *([_meshlm(*args)] if key == "train.nosuchkey" else [])]
    for proc in procs:
        assert proc.returncode == 2, proc.stderr
        assert key in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- every declared range


def _declared_keys() -> dict[str, type]:
    """Every key of every section, with its value type (int, float, bool or str)."""
    keys, cfg = {}, Config()
    for section in dataclasses.fields(Config):
        section_cls = type(getattr(cfg, section.name))
        for name, annotation in typing.get_type_hints(section_cls).items():
            allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
            keys[f"{section.name}.{name}"] = next(t for t in allowed if t is not type(None))
    return keys


def _invalid_values(key: str) -> list[str]:
    """Override texts this key must refuse, derived from its declared type and range: the nearest
    values outside each bound, 0 and -1 where those are outside too, nan/inf for numbers, a word
    outside the choices, blanks where it must be non-empty, and a value of the wrong type (none for
    text: an override's `3` for a text key is the text "3")."""
    typ, allowed = _declared_keys()[key], RANGES[key]
    wrong_type = {int: ["abc", "1.5"], float: ["abc"], bool: ["yes", "1"], str: [], list: ["3"]}[typ]
    values = []
    if typ in (int, float):
        step = 1 if typ is int else 1e-3
        if allowed.low is not None:
            values += [allowed.low - step] + [allowed.low] * allowed.low_open
            values += [v for v in (0, -1) if v < allowed.low or (v == allowed.low and allowed.low_open)]
        if allowed.high is not None:
            values += [allowed.high + step] + [allowed.high] * allowed.high_open
        if typ is float:
            values += ["nan", "inf"]
    if allowed.choices:
        values.append('"no-such-choice"')
    if allowed.nonempty:
        values += ['""', '" "']
    return [repr(v) if isinstance(v, (int, float)) else v for v in dict.fromkeys(values)] + wrong_type


def test_every_key_declares_its_range():
    """A new key without a RANGES entry fails here, so its check cannot go untested below."""
    assert set(RANGES) == set(_declared_keys())


CASES = [(key, text) for key in sorted(RANGES) for text in _invalid_values(key)]


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_key_refuses_what_is_outside_its_range(key):
    for text in _invalid_values(key):
        with pytest.raises(ConfigError) as err:
            resolve(load_config(None, [f"{key}={text}"]))
        message = str(err.value)
        assert message.startswith(f"{key}:") and "\n" not in message, (text, message)


@pytest.mark.parametrize("key", [k for k in sorted(RANGES) if RANGES[k].low is not None or RANGES[k].high is not None])
def test_every_numeric_bound_admits_the_bound_itself_unless_open(key):
    allowed = RANGES[key]
    for bound, is_open in ((allowed.low, allowed.low_open), (allowed.high, allowed.high_open)):
        if bound is not None:
            assert allowed.accepts(bound) != is_open, (key, bound)


def test_a_range_error_states_the_range_its_meaning_and_the_value():
    assert _range_error("train.steps", 0) == "train.steps: must be >= 1, got 0"
    assert _range_error("train.grad_clip", -1.0) == "train.grad_clip: must be >= 0 (0 disables), got -1.0"
    assert _range_error("train.beta2", 1.0) == "train.beta2: must be in [0, 1), got 1.0"
    assert _range_error("train.dtype", "fp8") == "train.dtype: must be one of float32, bfloat16, got 'fp8'"
    with pytest.raises(dataclasses.FrozenInstanceError):  # shared entries (POSITIVE_INT) stay as declared
        RANGES["train.steps"].low = 0


def _range_error(key, value) -> str:
    with pytest.raises(ConfigError) as err:
        RANGES[key].check(key, value)
    return str(err.value)


def test_the_configuration_reference_states_every_range_and_default():
    """docs/configuration.md is the spec users read: its 'accepts' and 'default' columns must be
    what the code enforces, so a bound loosened in RANGES fails here unless the docs change too."""
    from pathlib import Path

    doc = Path(__file__).parent.parent / "docs" / "configuration.md"
    rows = {}
    for line in doc.read_text().splitlines():
        if line.startswith("| `"):
            key, _, default, accepts, _ = (cell.strip() for cell in line.strip("|").split(" | "))
            rows[key.strip("`")] = (default, accepts)
    assert set(rows) == set(RANGES)
    cfg = Config()
    for key, (default, accepts) in rows.items():
        allowed = RANGES[key]
        assert accepts == allowed.describe() + (f" ({allowed.note})" if allowed.note else ""), key
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        assert default == ("unset" if value is None else toml_value(value)), key


def test_train_exits_2_with_one_line_for_every_refused_value(tmp_path, monkeypatch, capsys):
    """The CLI path of every case above, in process (a rank start per case would cost minutes):
    exit 2, one line naming the key, nothing run. A value that slipped through would reach the
    resume precheck, which is made to fail loudly here."""
    import meshlm.train.checkpoint.resume as resume

    def started(*_, **__):
        raise AssertionError("validation passed")

    monkeypatch.setattr(resume, "precheck", started)
    for key, text in CASES:
        assert cli.main(["train", f"run.dir={tmp_path}", f"{key}={text}"]) == 2, (key, text)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{key}:" in err and "Traceback" not in err, (key, text, err)


def test_an_override_that_reads_as_a_number_is_text_for_a_text_key():
    """`run.dir=2024` is a directory named 2024 (TOML reads the bare word as an integer); a
    number key still refuses text."""
    cfg = load_config(None, ["run.dir=2024", "run.sample_prompt=42"])
    assert (cfg.run.dir, cfg.run.sample_prompt) == ("2024", "42")
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_config(None, ["train.steps=abc"])


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_goes_away_gets_no_traceback(unbuffered):
    """`meshlm generate ... | head -3`: the reader closes the pipe before the output is written. The
    command ends quietly, exit 1 (a runtime failure), not with a BrokenPipeError traceback from its
    print (unbuffered stdout) or Python's 'Exception ignored' at exit (buffered)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import meshlm

    code = "import sys; from meshlm.cli import entry; sys.argv[0] = 'meshlm'; raise SystemExit(entry())"
    env = dict(os.environ, PYTHONPATH=str(Path(meshlm.__file__).parents[1]), PYTHONUNBUFFERED=unbuffered)
    proc = subprocess.Popen([sys.executable, "-c", code, "simulate", "pipeline", "--schedule", "1f1b", "--pp", "4",
                             "--microbatches", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before the child, still importing, writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_generate_help_names_every_source_it_reads(capsys):
    """`meshlm generate --checkpoint` reads a run directory, a final/ directory or a checkpoint
    directory (weights.load_trained; docs/checkpointing.md); its --help named only the first two."""
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "a checkpoint directory" in " ".join(capsys.readouterr().out.split())
