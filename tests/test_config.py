"""Configuration: loading, overrides, validation, and the CLI's exit-2 contract."""

import subprocess
import sys

import pytest

from meshlm.config import ConfigError, load_config, resolve, to_toml


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
    (["train.seq_len=99999"], "train.seq_len"),
    (["parallel.dp=3"], "parallel"),
    (["data.path=/no/such/file"], "data.path"),
    (["parallel.pp_layers=3,1"], "parallel.pp_layers"),  # pp=1: one stage, two counts
    (["parallel.pp_layers=four"], "parallel.pp_layers"),
])
def test_bad_values_raise_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, overrides))
    assert key in str(err.value) and "\n" not in str(err.value)


def test_an_explicit_pipeline_split_must_cover_every_layer_once():
    base = ["model.n_layers=4", "parallel.pp=2", "train.micro_batch_size=4", "train.global_batch_size=16"]
    assert resolve(load_config(None, [*base, "parallel.pp_layers=3,1"]), world_size=2).parallel.pp_layers == "3,1"
    for bad in ("3,2", "5,-1", "4"):
        with pytest.raises(ConfigError, match="parallel.pp_layers"):
            resolve(load_config(None, [*base, f"parallel.pp_layers={bad}"]), world_size=2)
    # Without a split the layers must divide evenly; with one they need not.
    with pytest.raises(ConfigError, match="parallel.pp_layers"):
        resolve(load_config(None, [*base, "model.n_layers=3"]), world_size=2)
    resolve(load_config(None, [*base, "model.n_layers=3", "parallel.pp_layers=2,1"]), world_size=2)


def test_bad_toml_file_names_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nsteps = 3\nlr = = 2\n")
    with pytest.raises(ConfigError, match=r"bad.toml.*line 3"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"))


def _meshlm(*args):
    return subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, key", [
    (["train", "train.nosuchkey=1"], "train.nosuchkey"),
    (["train", "train.steps=abc"], "train.steps"),
    (["train", "parallel.zero=9"], "parallel.zero"),
    (["train", "--nproc", "2", "parallel.dp=1"], "world size"),
    (["generate", "--checkpoint", "/no/such/dir"], "--checkpoint"),
])
def test_cli_exits_2_with_one_line_and_no_traceback(args, key, tmp_path):
    proc = _meshlm(*args, *([f"run.dir={tmp_path}"] if args[0] == "train" else []))
    assert proc.returncode == 2, proc.stderr
    assert key in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
