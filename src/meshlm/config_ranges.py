"""The range of every configuration key, declared once and checked generically.

`RANGES` maps each `section.key` to the values it accepts beyond its type. config.resolve()
checks them all before any rank starts; tests/test_config.py sweeps the table key by key and
checks docs/configuration.md against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshlm.errors import ConfigError
from meshlm.model.presets import PRESETS
from meshlm.parallel.compile import BACKENDS


@dataclass(frozen=True)
class Range:
    """The values one key accepts beyond its type: numeric bounds, a set of words, or non-empty.

    Every key of every section has one in RANGES (tests/test_config.py sweeps them all, so a new
    key cannot land without its check being exercised). None ("from the preset", "not set")
    passes; numbers must also be finite. Checks that need two keys or the world size stay in
    config.validate()."""

    low: float | None = None
    high: float | None = None  # only with a low bound: no key has an upper bound alone
    low_open: bool = False  # the bound itself is excluded
    high_open: bool = False
    choices: tuple[str, ...] = ()
    nonempty: bool = False
    note: str = ""  # what a boundary value means, e.g. "0 disables"

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return "non-empty" if self.nonempty else "any"

    def accepts(self, value: Any) -> bool:
        if value is None or isinstance(value, (bool, list)):  # a list (data.blend) is checked in validate()
            return True
        if isinstance(value, str):
            return (not self.choices or value in self.choices) and (not self.nonempty or bool(value.strip()))
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def check(self, key: str, value: Any) -> None:
        if not self.accepts(value):
            note = f" ({self.note})" if self.note else ""
            raise ConfigError(f"{key}: must be {self.describe()}{note}, got {value!r}")


def _at_least(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


def _above(low: float) -> Range:
    return Range(low=low, low_open=True)


ANY = Range()  # type-checked only: flags, paths checked where they are read, free text
POSITIVE_INT = _at_least(1)

RANGES: dict[str, Range] = {
    "model.preset": Range(choices=tuple(PRESETS)),
    **{f"model.{k}": POSITIVE_INT for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                            "max_seq_len")},
    "model.rope_theta": _above(0),
    "model.rope_scaling": Range(choices=("none", "llama3")),  # its numbers: config.validate()
    "model.rope_factor": _at_least(1),
    "model.rope_low_freq_factor": _above(0),
    "model.rope_high_freq_factor": _above(0),  # and above the low one: config.validate()
    "model.rope_original_max_seq_len": POSITIVE_INT,
    "model.tie_embeddings": ANY,
    "model.norm_eps": _above(0),
    "model.init_from": ANY,  # a directory: read (and its errors named) in resolve()
    **{f"train.{k}": POSITIVE_INT for k in ("steps", "seq_len", "micro_batch_size", "global_batch_size",
                                            "eval_batches", "log_interval")},
    "train.lr": _above(0),
    "train.min_lr_ratio": Range(low=0, high=1),
    "train.warmup_steps": _at_least(0),
    "train.lr_decay": Range(choices=("cosine", "linear", "sqrt")),
    "train.decay_fraction": Range(low=0, high=1, low_open=True),
    "train.weight_decay": _at_least(0),
    "train.beta1": Range(low=0, high=1, high_open=True),
    "train.beta2": Range(low=0, high=1, high_open=True),
    "train.eps": _above(0),  # 0 turns an exactly-zero gradient into 0/0 in Adam's update
    "train.grad_clip": _at_least(0, "0 disables"),
    "train.dtype": Range(choices=("float32", "bfloat16")),
    "train.recompute": Range(choices=("none", "full", "selective")),
    "train.compile": ANY,
    "train.compile_backend": Range(choices=BACKENDS),
    "train.eval_interval": _at_least(0, "0 disables"),
    "train.peak_tflops": _above(0),
    "train.track_memory": ANY,
    "train.memory_interval": POSITIVE_INT,
    "train.keep_host_memory": ANY,
    "train.on_nonfinite": Range(choices=("stop", "skip")),
    "parallel.dp": _at_least(0, "0 = world size / (tp*cp*pp)"),
    **{f"parallel.{k}": POSITIVE_INT for k in ("tp", "pp", "cp", "pp_virtual")},
    "parallel.zero": Range(low=0, high=3),
    "parallel.sp": ANY,
    "parallel.pp_schedule": Range(choices=("gpipe", "1f1b", "interleaved")),
    "parallel.pp_microbatches": _at_least(0, "0 = global batch / (dp * micro-batch)"),
    "parallel.pp_layers": ANY,  # a list of layer counts: parsed and checked with the layout (mesh.py)
    "parallel.pp_defer_wgrad": ANY,
    "parallel.backend": Range(choices=("auto", "gloo", "nccl")),  # and usable here: cli.cmd_train
    "data.path": ANY,  # checked to exist in validate()
    "data.val_fraction": Range(low=0, high=0.5, low_open=True, high_open=True),
    "data.cache_dir": ANY,
    "data.tokenizer": ANY,  # loaded (and its errors named) in validate()
    "data.text_field": Range(nonempty=True),
    "data.workers": _at_least(0, "0 = the cores"),
    "data.tokenizer_sample_bytes": POSITIVE_INT,
    "data.blend": ANY,  # [[weight, path], ...]: checked in validate() (data/blend.py)
    "checkpoint.interval": _at_least(0, "0 = only final/"),
    "checkpoint.keep": POSITIVE_INT,
    "checkpoint.resume": Range(nonempty=True, note="auto, never or a checkpoint directory"),
    "checkpoint.async_save": ANY,
    "checkpoint.stop_timeout_s": _above(0),
    "debug.timeout_s": _above(0),
    "debug.startup_timeout_s": _above(0),
    "debug.fault": Range(choices=("none", "kill", "hang", "desync", "raise", "nan", "slow", "oom")),
    "debug.fault_rank": _at_least(0),  # and below the world size: validate()
    "debug.fault_step": POSITIVE_INT,
    "debug.fault_slow_s": _above(0),
    "debug.straggler_threshold": _above(0),
    "run.dir": Range(nonempty=True),
    "run.seed": _at_least(0),  # numpy's SeedSequence (the data order) rejects negative seeds
    "run.sample_tokens": _at_least(0, "0 = no sample"),
    "run.sample_prompt": ANY,
}


def check_ranges(cfg) -> None:
    """Every key of `cfg` (a config.Config) against its range: ConfigError naming the first bad one."""
    for key, allowed in RANGES.items():
        section, name = key.split(".")
        allowed.check(key, getattr(getattr(cfg, section), name))
