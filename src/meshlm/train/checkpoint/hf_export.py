"""Export: a meshlm checkpoint (saved under any layout) or final/ directory -> a Hugging Face
Llama directory that `transformers` loads with `LlamaForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`:

    config.json            LlamaConfig (shape, rope_theta and llama3 rope scaling, rms_norm_eps,
                           tied head, dtype)
    model.safetensors      the full weights under transformers' names (hf.hf_name), fp32 by
                           default, or rounded to bf16 / fp16 (`dtype`)
    tokenizer.json         the run's tokenizer, byte for byte
    tokenizer_config.json  PreTrainedTokenizerFast, with the end-of-text token as eos and bos

Tensors are assembled and written one at a time (the safetensors file is streamed: header
first, then each tensor's bytes), so exporting needs the memory of the largest tensor, not of
the model. The directory is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from meshlm.config import ConfigError, ModelConfig, load_config
from meshlm.errors import unusable_directory
from meshlm.train.checkpoint.hf import HF_CONFIG, HF_WEIGHTS, hf_name
from meshlm.train.checkpoint.store import write_safetensors
from meshlm.train.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, chat_template, load_tokenizer, run_end_token


@dataclass
class ExportReport:
    out: Path
    source: Path  # the checkpoint or final/ directory exported
    step: int | None  # the checkpoint's step (None for final/)
    n_params: int
    bytes: int  # of model.safetensors
    seconds: float


class _Source:
    """The full tensors of a trained model under meshlm's names, one at a time."""

    path: Path
    model: ModelConfig
    shapes: dict[str, tuple[int, ...]]  # every stored tensor (a tied head is the embedding, once)
    tokenizer: Path
    step: int | None

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _CheckpointSource(_Source):
    def __init__(self, path: Path) -> None:
        from meshlm.train.checkpoint.store import CheckpointReader
        from meshlm.train.weights import held_copy

        self.path = path
        # A train running in the run directory may delete this checkpoint (checkpoint.keep) while
        # the export runs: the tokenizer's files are copied first (they were read last), then the
        # reader maps every rank file, and from there on a deletion changes nothing.
        self._held = held_copy(path, ("tokenizer.json", TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE))
        self.tokenizer = Path(self._held.name) / "tokenizer.json"
        try:
            self.reader = CheckpointReader(path)
        except BaseException:  # deleted before it was open: open_trained looks again, with a new copy
            self._held.cleanup()
            raise
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        self.model = ModelConfig(**{k: v for k, v in self.reader.meta["model"].items() if k in known})
        self.shapes = self.reader.shapes
        self.step = self.reader.meta["step"]

    def close(self) -> None:
        self._held.cleanup()

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.full("model", name)


class _FinalSource(_Source):
    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        from meshlm.train.checkpoint.pieces import EMBEDDING, TIED_HEAD, canonical_shapes

        self.path = path
        self.model = load_config(str(path / "config.toml")).model  # saved resolved: every field set
        self.shapes = canonical_shapes(self.model)
        self.tokenizer = path / "tokenizer.json"
        self.step = None
        self.file = safe_open(str(path / "model.safetensors"), framework="pt", device="cpu")
        # save_final stores a tied embedding once, under whichever of its two names it kept.
        self.alias = {EMBEDDING: TIED_HEAD} if EMBEDDING not in self.file.keys() else {}

    def tensor(self, name: str) -> torch.Tensor:
        return self.file.get_tensor(self.alias.get(name, name)).float()


# --------------------------------------------------------------------------- what is written


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rope_config(m: ModelConfig) -> dict:
    """The rope keys of config.json: `rope_theta` and `rope_parameters` (transformers 5); with
    scaling, also the legacy `rope_scaling` that transformers 4 reads (without rope_theta, which
    its validation would call unrecognised; 5 takes rope_theta from beside it)."""
    if m.rope_scaling != "llama3":
        return {"rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
    scaling = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
               "high_freq_factor": m.rope_high_freq_factor,
               "original_max_position_embeddings": m.rope_original_max_seq_len}
    return {"rope_theta": m.rope_theta, "rope_parameters": {**scaling, "rope_theta": m.rope_theta},
            "rope_scaling": scaling}


def llama_config(m: ModelConfig, end_id: int | None, dtype: str = "float32") -> dict:
    """config.json for meshlm model `m`: the fields LlamaConfig reads, in transformers 4 and 5
    spellings (rope_theta / rope_parameters / rope_scaling, torch_dtype / dtype)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.dim // m.n_heads,
        "vocab_size": m.vocab_size, "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        **rope_config(m),
        "tie_word_embeddings": bool(m.tie_embeddings), "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "torch_dtype": dtype, "dtype": dtype, "use_cache": True,
        "bos_token_id": end_id, "eos_token_id": end_id, "pad_token_id": None,
    }


def end_of_text(tokenizer_path: Path) -> tuple[str | None, int | None]:
    """The document separator meshlm trained with (tokenizer.run_end_token); it is both eos and
    bos, as in GPT-2: meshlm prepends no BOS."""
    return run_end_token(tokenizer_path)


def tokenizer_config(end_token: str | None, max_len: int, template=None) -> dict:
    # clean_up_tokenization_spaces would rewrite " ," to "," on decode: a byte-level BPE
    # round-trips text exactly and must decode exactly as meshlm does. `template`: the chat
    # template of a pretrained tokenizer (tokenizer.chat_template), kept for apply_chat_template.
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
            "bos_token": end_token, "eos_token": end_token, "unk_token": None, "pad_token": None,
            "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
            "clean_up_tokenization_spaces": False, **({"chat_template": template} if template else {})}


# --------------------------------------------------------------------------- the command


def _open_source(path: Path) -> _Source:
    from meshlm.train.weights import open_trained

    return open_trained(path, lambda kind, found: _CheckpointSource(found) if kind == "checkpoint"
                        else _FinalSource(found), prefer="checkpoint")


EXPORTED = (HF_WEIGHTS, HF_CONFIG, "tokenizer.json", TOKENIZER_CONFIG)  # what an export writes, all of it


def _check_out(out: Path) -> None:
    """`out` may be new, empty, or an earlier export (replaced whole: nothing in it but what an
    export writes); anything else is kept safe, another model's directory above all."""
    if not out.exists():
        if problem := unusable_directory(out, "--out"):
            raise ConfigError(problem)
        return
    foreign = [] if not out.is_dir() else sorted(p.name for p in out.iterdir() if p.name not in EXPORTED)
    if not out.is_dir() or foreign or (any(out.iterdir()) and not (out / HF_CONFIG).is_file()):
        what = f"it holds {foreign[0]}, which no export writes" if foreign else "it is not an earlier export"
        raise ConfigError(f"--out: {out} exists and {what}; choose a new directory")


def export_hf(source: Path, out: Path, dtype: str = "float32") -> ExportReport:
    """Write the Hugging Face Llama directory `out` from `source` (a checkpoint directory, a run
    directory: its newest good checkpoint, or a final/ directory), its weights in `dtype` (one of
    EXPORT_DTYPES: the fp32 masters as they are, or rounded to nearest)."""
    t0 = time.perf_counter()
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    src = _open_source(Path(source))
    try:
        return _export(src, Path(out), dtype, torch_dtype, t0)
    finally:
        src.close()


def _export(src: _Source, out: Path, dtype: str, torch_dtype: torch.dtype, t0: float) -> ExportReport:
    out = out.resolve()  # `.` has no name to put a temporary directory beside
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        names = sorted(src.shapes)  # meshlm names; a tied head is not among them
        theirs = {hf_name(name): src.shapes[name] for name in names}
        ours = {hf_name(name): name for name in names}
        layout = {hf: (torch_dtype, tuple(shape)) for hf, shape in theirs.items()}
        # One tensor in memory at a time: export needs the memory of the largest, not of the model.
        size = write_safetensors(tmp / HF_WEIGHTS, layout, lambda hf: src.tensor(ours[hf]).to(torch_dtype),
                                 {"format": "pt"})["bytes"]
        end_token, end_id = end_of_text(src.tokenizer)
        (tmp / HF_CONFIG).write_text(json.dumps(llama_config(src.model, end_id, dtype), indent=2) + "\n")
        shutil.copyfile(src.tokenizer, tmp / "tokenizer.json")
        (tmp / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(end_token, src.model.max_seq_len,
                                                                        chat_template(src.tokenizer)),
                                                       indent=2) + "\n")
        if out.exists():  # empty or an earlier export: its files replaced one by one, the directory
            for name in EXPORTED:  # kept (it may be the working directory of whoever runs this)
                os.replace(tmp / name, out / name)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(int(torch.Size(s).numel()) for s in src.shapes.values())
    return ExportReport(out, src.path, src.step, n_params, size, time.perf_counter() - t0)
