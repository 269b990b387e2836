"""Configuration: dataclasses, TOML files, `key=value` overrides, validation with one-line errors.

Every run is described by one `Config`. It is loaded from an optional TOML file, then dotted
overrides from the command line (`train.steps=50 parallel.dp=2`), then resolved (model preset
filled in, dp inferred from the world size) and validated before any rank starts. Any problem is
a `ConfigError` whose message names the offending key; the CLI prints it and exits 2.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlm.config_ranges import RANGES, check_ranges  # noqa: F401 (RANGES: re-exported)
from meshlm.errors import ConfigError, RunError, unusable_directory  # noqa: F401 (RunError: re-exported)
from meshlm.model.presets import PRESETS




@dataclass
class ModelConfig:
    preset: str = "tiny"
    # None means "take it from the preset".
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    # RoPE scaling for contexts beyond pretraining (model/llama.py, Llama3Scaling): "none", or
    # "llama3" (Llama 3.1 / 3.2) with the four numbers below, all required then. Unset: "none",
    # or what model.init_from's config.json says (its rope_scaling / rope_parameters).
    rope_scaling: str | None = None
    rope_factor: float | None = None  # low frequencies' positions divided by this
    rope_low_freq_factor: float | None = None  # wavelengths above original / this: scaled
    rope_high_freq_factor: float | None = None  # wavelengths below original / this: kept
    rope_original_max_seq_len: int | None = None  # the pretraining context length
    tie_embeddings: bool | None = None
    norm_eps: float = 1e-5
    # A Hugging Face Llama directory (or a meshlm checkpoint) to start from: weights only, fresh
    # optimizer and step 0 (fine-tuning); its config.json sets the shape, its tokenizer the data's.
    init_from: str | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class TrainConfig:
    steps: int = 300
    seq_len: int = 128
    micro_batch_size: int = 8  # 2 micro-batches per step on one rank, 1 per rank at dp=2
    global_batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    # The decay after warmup (train/optim.py): its shape, and the fraction of the post-warmup steps
    # it takes, the last ones; before it the rate holds at train.lr. decay_fraction < 1 is
    # warmup-stable-decay (WSD: Megatron-LM's lr-decay-style WSD, torchtitan's decay_ratio).
    lr_decay: str = "cosine"
    decay_fraction: float = 1.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: str = "float32"
    recompute: str = "none"
    # Compile every transformer block with torch.compile, one block at a time as torchtitan does
    # (parallel/compile.py): fused kernels for some seconds of compile time at start-up.
    # compile_backend is torchtitan's compile.backend: inductor generates the code; aot_eager traces
    # the same graphs (forward and backward, through AOTAutograd) but runs eager kernels, so it
    # starts in a fraction of the time (the tests use it); eager only captures the graphs.
    compile: bool = False
    compile_backend: str = "inductor"
    eval_interval: int = 100
    # Global batches of held-out windows per evaluation (Megatron's eval-iters), run as micro-batches:
    # the same windows whatever the micro-batch split. 4 x the default 16 = the 64 windows it always was.
    eval_batches: int = 4
    log_interval: int = 10
    # Peak dense TFLOP/s of one device for MFU; None = look the device up in a table.
    peak_tflops: float | None = None
    # Measure each rank's peak memory (CPU: a dispatch-mode tracker counting live tensor bytes, on
    # the first two steps a process runs and every memory_interval-th step, as it costs step time;
    # CUDA: every step, free).
    track_memory: bool = True
    memory_interval: int = 100
    # CPU runs: glibc malloc keeps freed memory for the next step (train/host_memory.py).
    keep_host_memory: bool = True
    # A non-finite loss or gradient norm: never applied; stop = exit 1 with a report, skip = drop
    # that step's update, count it and go on (debug/nonfinite.py).
    on_nonfinite: str = "stop"


@dataclass
class ParallelConfig:
    dp: int = 0  # 0 = world size / (tp * cp * pp)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    sp: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0  # 0 = global batch / (dp * micro-batch)
    pp_virtual: int = 1
    # Layers per virtual stage, first to last, e.g. "3,1" (pp=2) to leave the last stage, which
    # also carries the head and the loss, fewer layers; "" = balanced by layer count.
    pp_layers: str = ""
    # Pipeline stages send their input gradient before computing weight gradients (the B/W split,
    # parallel/pipeline/deferred_wgrad.py). Applies with zero 0 and 1; ZeRO-2/3 reduce within each
    # backward pass and so keep the plain backward.
    pp_defer_wgrad: bool = True
    # The collectives library: auto = nccl where CUDA and NCCL are usable, else gloo. gloo on a GPU
    # machine trains on the CPU; nccl needs one visible GPU per rank (refused before ranks start).
    backend: str = "auto"


@dataclass
class DataConfig:
    path: str | None = None  # a text file or a directory of them; None = the default corpus
    val_fraction: float = 0.01
    cache_dir: str | None = None  # None = $MESHLM_CACHE or ~/.cache/meshlm
    # A pretrained tokenizer (tokenizer.json, or a directory holding one) instead of training a BPE.
    tokenizer: str | None = None
    text_field: str = "text"  # the JSONL field / Parquet column that holds a document's text
    workers: int = 0  # tokenizing processes; 0 = the cores this process may run on
    # meshlm's own BPE is trained on at most this many bytes of training text, spread evenly over
    # the corpus (as SentencePiece samples sentences): bounded time and memory for any corpus.
    tokenizer_sample_bytes: int = 64_000_000
    # [[weight, path], ...]: several corpora mixed by weight (data/blend.py); replaces data.path.
    blend: list | None = None


@dataclass
class CheckpointConfig:
    # Steps between checkpoints (and one at the end of training); 0 = no checkpoints, only final/.
    interval: int = 100
    keep: int = 2  # the newest K complete checkpoints are kept
    # auto: continue from the newest good checkpoint in run.dir/checkpoints if there is one;
    # never: start fresh; or a checkpoint directory (or a run directory: its newest) to load.
    resume: str = "auto"
    # Copy the state, then write, hash and fsync it on a background thread while training goes on
    # (training is blocked only for the copy); off: training waits for the whole save.
    async_save: bool = False
    # After SIGTERM/SIGINT a rank saves at the next step boundary; past this many seconds it
    # exits without saving (torchrun SIGKILLs its workers 30 s after forwarding the signal).
    stop_timeout_s: float = 25.0


@dataclass
class DebugConfig:
    # The watchdog (debug/watchdog.py): a rank with no collective started or finished and no phase
    # change for this long dumps its state to run.dir/debug/ and the job exits 1; the first step
    # (building, loading, warm-up) and checkpoint writes get the longer startup limit.
    timeout_s: float = 300.0
    startup_timeout_s: float = 900.0
    # An injected failure (debug/faults.py) on rank `fault_rank` at step `fault_step`: kill, hang,
    # desync, raise, nan, slow (sleep `fault_slow_s` every step from then on) or oom.
    fault: str = "none"
    fault_rank: int = 0
    fault_step: int = 1
    fault_slow_s: float = 0.5
    # A rank whose own work per step exceeds the other ranks' median by this fraction for 3 steps
    # in a row is named in a warning (debug/stragglers.py).
    straggler_threshold: float = 0.2


@dataclass
class RunConfig:
    dir: str = "runs/meshlm"
    seed: int = 1234
    sample_tokens: int = 120
    sample_prompt: str = "ROMEO:"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    run: RunConfig = field(default_factory=RunConfig)


# --------------------------------------------------------------------------- loading


def _field_types(section_cls) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(key: str, value: Any, annotation: Any, text: str | None = None) -> Any:
    """Check `value` against a field annotation (int, float, bool, str, list, or X | None)."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None and type(None) in allowed:
        return None
    if value is None and str in allowed:  # `train.recompute=none`: the word, where None is no value
        return "none"
    for typ in allowed:
        if typ is bool and isinstance(value, bool):
            return value
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if typ is str and isinstance(value, str):
            return value
        if typ is list and isinstance(value, list):  # its shape is checked in validate()
            return value
        if typ is str and isinstance(value, float) and not math.isfinite(value):
            return str(value)  # `debug.fault=nan`: TOML reads the bare word as a float
    if text is not None and str in allowed:  # an override's `run.dir=2024`: the text, for a text key
        return text
    names = " or ".join({int: "an integer", float: "a number", bool: "true/false", str: "a string", list: "a list"}.get(t, "none")
                        for t in allowed if t is not type(None))
    raise ConfigError(f"{key}: expected {names}, got {value!r}")


def _parse_override_value(text: str) -> Any:
    """`3` -> 3, `1e-3` -> 0.001, `true` -> True, `"x"` or `x` -> "x", `none` -> None."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply(cfg: Config, key: str, value: Any, text: str | None = None) -> None:
    section_name, _, name = key.partition(".")
    if not name or "." in name:
        raise ConfigError(f"{key}: keys have the form section.name, e.g. train.steps")
    if section_name not in _field_types(Config):
        raise ConfigError(f"{key}: unknown section {section_name!r} (known: {', '.join(_field_types(Config))})")
    section = getattr(cfg, section_name)
    types_ = _field_types(type(section))
    if name not in types_:
        raise ConfigError(f"{key}: unknown key (known in [{section_name}]: {', '.join(types_)})")
    setattr(section, name, _coerce(key, value, types_[name], text))


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Read an optional TOML file, then apply `section.key=value` overrides. Not yet resolved."""
    cfg = Config()
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config file ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section_name, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: {section_name}: expected a [{section_name}] table")
            for name, value in table.items():
                _apply(cfg, f"{section_name}.{name}", value)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item}: overrides have the form section.key=value")
        _apply(cfg, key.strip(), _parse_override_value(text.strip()), text.strip())
    return cfg


# --------------------------------------------------------------------------- resolution and validation


def resolve(cfg: Config, world_size: int = 1) -> Config:
    """Fill the model from its preset (or from model.init_from), infer dp from the world size,
    and validate everything."""
    m = cfg.model
    if m.init_from is not None:
        from meshlm.train.checkpoint.hf import take_init_source

        take_init_source(cfg)
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {m.preset!r} (known: {', '.join(PRESETS)})")
    if m.vocab_size is None and cfg.data.tokenizer is not None:  # the embedding follows a pretrained tokenizer
        from meshlm.train.tokenizer import load_pretrained

        m.vocab_size = load_pretrained(cfg.data.tokenizer).n_ids
    for name, value in PRESETS[m.preset].items():
        if getattr(m, name) is None:
            setattr(m, name, value)
    if m.rope_scaling is None:
        m.rope_scaling = "none"
    check_ranges(cfg)
    p = cfg.parallel
    model_parallel = p.tp * p.cp * p.pp
    if p.dp == 0:
        if world_size % model_parallel:
            raise ConfigError(f"parallel.tp*cp*pp = {model_parallel} does not divide the world size {world_size}")
        p.dp = world_size // model_parallel
    validate(cfg, world_size)
    if m.init_from is not None:  # the stored tensors fit the model just resolved (headers only)
        from meshlm.train.checkpoint.hf import open_weights

        open_weights(Path(m.init_from), m)
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


ROPE_SCALING_KEYS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")


def check_rope_scaling(m: ModelConfig) -> None:
    """model.rope_scaling=llama3 needs its four numbers (and a non-empty blend band); without
    scaling, none of them may be set (they would silently do nothing)."""
    if m.rope_scaling == "none":
        for key in ROPE_SCALING_KEYS:
            _require(getattr(m, key) is None, f"model.{key}: {getattr(m, key)} is set, but model.rope_scaling is "
                                              f"none; set model.rope_scaling=llama3 or leave model.{key} unset")
        return
    for key in ROPE_SCALING_KEYS:
        _require(getattr(m, key) is not None,
                 f"model.{key}: required with model.rope_scaling={m.rope_scaling} (Llama 3.1: rope_factor=8, "
                 f"rope_low_freq_factor=1, rope_high_freq_factor=4, rope_original_max_seq_len=8192)")
    _require(m.rope_high_freq_factor > m.rope_low_freq_factor,
             f"model.rope_high_freq_factor: {m.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
             f"{m.rope_low_freq_factor}")


def validate(cfg: Config, world_size: int) -> None:
    """The checks that relate keys to each other and to the world size; resolve() has already
    checked each key's own range (RANGES)."""
    m, t, p, d = cfg.model, cfg.train, cfg.parallel, cfg.data
    _require(m.dim % m.n_heads == 0, f"model.dim: {m.dim} is not divisible by model.n_heads={m.n_heads}")
    _require(m.head_dim % 2 == 0, f"model.dim: head dim {m.head_dim} (dim / n_heads) must be even for RoPE")
    check_rope_scaling(m)
    _require(m.n_kv_heads <= m.n_heads and m.n_heads % m.n_kv_heads == 0,
             f"model.n_kv_heads: {m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    _require(m.vocab_size >= 260 or d.tokenizer is not None,
             f"model.vocab_size: {m.vocab_size} is too small for a byte-level BPE (>= 260)")
    _require(t.seq_len <= m.max_seq_len, f"train.seq_len: {t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")

    layout = p.dp * p.tp * p.cp * p.pp
    _require(layout == world_size,
             f"parallel: dp*tp*cp*pp = {p.dp}*{p.tp}*{p.cp}*{p.pp} = {layout} does not equal the world size {world_size}")
    # parallel.pp_microbatches (pipelines only) sets the micro-batch count; the size follows from it.
    if p.pp > 1 and p.pp_microbatches:  # the micro-batch size then follows from the count
        _require(t.global_batch_size % p.dp == 0,
                 f"train.global_batch_size: {t.global_batch_size} is not divisible by dp = {p.dp}")
    else:
        _require(t.global_batch_size % (t.micro_batch_size * p.dp) == 0,
                 f"train.global_batch_size: {t.global_batch_size} is not divisible by "
                 f"micro_batch_size*dp = {t.micro_batch_size}*{p.dp}")
    from meshlm.mesh import check_layout  # the checks that need model and layout together

    check_layout(cfg, world_size)
    from meshlm.parallel.pipeline.schedules import check_pipeline_config

    check_pipeline_config(p, t)
    _require(not p.sp or p.tp > 1, "parallel.sp=true: sequence parallelism shards along tp; it needs parallel.tp > 1")

    if d.path is not None:  # ~ as the corpus reader and data.blend read it
        _require(Path(d.path).expanduser().exists(), f"data.path: {d.path} does not exist")
    for key, where in (("run.dir", cfg.run.dir), ("data.cache_dir", d.cache_dir)):
        problem = unusable_directory(where, key) if where is not None else None
        _require(problem is None, problem)
    if d.blend is not None:  # [[weight, path], ...]: the shape, positive weights, existing paths
        from meshlm.data.blend import parse_blend

        parse_blend(d.blend, d.path)
    if d.tokenizer is not None:  # a pretrained tokenizer: usable, and its ids fit the embedding
        from meshlm.train.tokenizer import load_pretrained

        pretrained = load_pretrained(d.tokenizer)
        _require(pretrained.n_ids <= m.vocab_size,
                 f"model.vocab_size: {m.vocab_size} is smaller than the vocabulary of data.tokenizer "
                 f"{pretrained.path} ({pretrained.n_ids} ids)")
    _require(cfg.debug.fault_rank < world_size,
             f"debug.fault_rank: must be in 0..{world_size - 1}, got {cfg.debug.fault_rank}")
