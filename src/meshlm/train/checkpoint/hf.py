"""Hugging Face Llama interop, the import side: the name mapping, a Llama directory's config.json
as meshlm's model shape, and a lazy reader of its weights (`model.init_from` and `meshlm import`
use them: train/checkpoint/hf_import.py).

meshlm's Llama and transformers' `LlamaForCausalLM` compute the same function (tests/test_model.py)
with the same tensor layouts, so moving weights between them is a pure renaming:
- both apply rotary embeddings with `rotate_half` (dimension i paired with i + head_dim/2), so q
  and k rows need no permutation. The permutation found in conversion scripts undoes Meta's
  original interleaved-pair (complex) layout; neither side here uses it;
- `nn.Linear` weights are [out, in] on both sides; RMSNorm weights are plain vectors;
- a tied head has no tensor of its own: transformers omits `lm_head.weight`, meshlm `output.weight`.

`model.init_from=DIR` takes a Hugging Face directory (config.json + model.safetensors, or shards
listed by model.safetensors.index.json) or a meshlm checkpoint directory. `resolve()` takes the
model's shape from it (`init_source_fields`); each rank then reads only the rectangles of each
tensor that it owns (`HFReader.read`, slices straight from the memory-mapped files) through the
same `load_weights` that checkpoint resharding uses. Training starts at step 0 with a fresh
optimizer: only the weights are taken, never the AdamW moments or the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from meshlm.errors import ConfigError
from meshlm.train.checkpoint.pieces import Rect

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_HEAD = "lm_head.weight"

# meshlm module name -> transformers module name, inside each decoder layer and at the top.
LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
HF_NAMES = {**TOP_NAMES, **LAYER_NAMES}  # every renamed module, for docs and tests


def hf_name(name: str) -> str:
    """The transformers name of meshlm parameter `name`, e.g. layers.0.attention.wq.weight ->
    model.layers.0.self_attn.q_proj.weight."""
    parts = name.split(".")
    if parts[0] == "layers":
        module = ".".join(parts[2:-1])
        if module not in LAYER_NAMES:
            raise KeyError(f"no Hugging Face name for {name!r}")
        return f"model.layers.{parts[1]}.{LAYER_NAMES[module]}.{parts[-1]}"
    module = ".".join(parts[:-1])
    if module not in TOP_NAMES:
        raise KeyError(f"no Hugging Face name for {name!r}")
    return f"{TOP_NAMES[module]}.{parts[-1]}"


# --------------------------------------------------------------------------- config.json


def is_meshlm_checkpoint(path: Path) -> bool:
    return (path / "manifest.json").is_file()


def _load_json(path: Path, key: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path}: unreadable ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {path}: expected a JSON object")
    return value


def read_llama_config(path: Path, key: str = "model.init_from") -> dict:
    """config.json of Hugging Face directory `path`; ConfigError (one line, naming `key`) unless
    it describes a Llama that meshlm's model computes exactly."""
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a directory (expected a Hugging Face Llama directory "
                          f"or a meshlm checkpoint directory)")
    if not (path / HF_CONFIG).is_file():
        raise ConfigError(f"{key}: {path} has no {HF_CONFIG} (not a Hugging Face model directory) and no "
                          f"manifest.json (not a meshlm checkpoint)")
    hf = _load_json(path / HF_CONFIG, key)
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type") != "llama" or "LlamaForCausalLM" not in architectures:
        raise ConfigError(f"{key}: {path} holds a {hf.get('model_type')!r} model ({', '.join(map(str, architectures))}); "
                          f"meshlm imports Llama (model_type 'llama', LlamaForCausalLM) only")
    unsupported = [(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r} (meshlm: silu)"),
                   (bool(hf.get("attention_bias")), "attention_bias true"),
                   (bool(hf.get("mlp_bias")), "mlp_bias true"),
                   (_rope_type(hf) not in ROPE_TYPES, f"rope scaling {_rope_type(hf)!r}")]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"{key}: {path}: {what} is not supported by meshlm's Llama"
                              + (" (of the scalings, only 'llama3')" if what.startswith("rope") else ""))
    return hf


ROPE_TYPES = ("default", "llama3")  # what meshlm's Llama computes (model/llama.py: Llama3Scaling)
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")  # and original_max_position_embeddings


def _rope_kind(params) -> str:
    return params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"


def _rope_parameters(hf: dict) -> dict:
    """The rope settings transformers applies: transformers 4 reads a legacy `rope_scaling`, and 5,
    which keeps them in `rope_parameters`, still lets a `rope_scaling` in config.json replace them;
    so `rope_scaling` when there is one, else `rope_parameters`."""
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if isinstance(params, dict) and params:
            return params
    return {}


def _rope_type(hf: dict) -> str:
    """The rope type transformers applies; but a type meshlm does not compute, named by either key,
    wins (a config.json may carry both, and which one a given transformers reads is refused safe)."""
    for params in (hf.get("rope_parameters"), hf.get("rope_scaling")):
        if _rope_kind(params) not in ROPE_TYPES:
            return _rope_kind(params)
    return _rope_kind(_rope_parameters(hf))


def _rope_fields(hf: dict, where: Path) -> dict:
    """model.rope_theta and the rope scaling keys of a Llama config.json (read_llama_config has
    refused any rope type but default and llama3)."""
    rope = _rope_parameters(hf)
    fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), "rope_scaling": "none",
              "rope_factor": None, "rope_low_freq_factor": None, "rope_high_freq_factor": None,
              "rope_original_max_seq_len": None}
    if _rope_type(hf) == "llama3":
        missing = [k for k in LLAMA3_KEYS if not isinstance(rope.get(k), (int, float)) or isinstance(rope.get(k), bool)]
        if missing:
            raise ConfigError(f"model.init_from: {where / HF_CONFIG}: its llama3 rope scaling has no number "
                              f"{missing[0]}")
        # transformers falls back on max_position_embeddings, as here
        original = rope.get("original_max_position_embeddings",
                            hf.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048)))
        fields.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]), rope_original_max_seq_len=int(original))
        from meshlm.config import ModelConfig, check_rope_scaling
        from meshlm.config_ranges import RANGES

        try:  # numbers out of range are the file's fault, not a key the user set: name the file
            for name, value in fields.items():
                RANGES[f"model.{name}"].check(f"model.{name}", value)
            check_rope_scaling(ModelConfig(**fields))
        except ConfigError as e:
            raise ConfigError(f"model.init_from: {where / HF_CONFIG}: its llama3 rope scaling gives {e}") from None
    return fields


def model_fields_from_hf(hf: dict, where: Path) -> dict:
    """meshlm ModelConfig fields from a Llama config.json (its defaults where a key is absent)."""
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = {"dim": dim, "n_layers": int(hf["num_hidden_layers"]), "n_heads": heads,
                  "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
                  "ffn_dim": int(hf["intermediate_size"]), "vocab_size": int(hf["vocab_size"]),
                  "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
                  **_rope_fields(hf, where),
                  "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                  "norm_eps": float(hf.get("rms_norm_eps", 1e-6))}
    except KeyError as e:
        raise ConfigError(f"model.init_from: {where / HF_CONFIG} has no {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.init_from: {where / HF_CONFIG}: {e}") from None
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads and head_dim != dim // heads:
        raise ConfigError(f"model.init_from: {where}: head_dim {head_dim} != hidden_size / num_attention_heads "
                          f"= {dim // heads}; meshlm's Llama needs them equal")
    return fields


def init_source(path: Path) -> Path:
    """What model.init_from names, as the directory to read: a meshlm run directory stands for its
    newest complete checkpoint (as `generate` and `export` take one); a run's final/ (one
    safetensors file under meshlm's names, which no reader here takes) is refused with the way round."""
    from meshlm.train.checkpoint.store import list_checkpoints

    if (path / HF_CONFIG).is_file() or is_meshlm_checkpoint(path):
        return path
    complete = [p for p in list_checkpoints(path / "checkpoints") if is_meshlm_checkpoint(p)]
    if complete:
        return complete[-1]
    if (path / "model.safetensors").is_file() and (path / "config.toml").is_file():
        raise ConfigError(f"model.init_from: {path} is a meshlm final/ directory: start from one of its run's "
                          f"checkpoints, or from its Hugging Face export (meshlm export --checkpoint {path} --out DIR)")
    return path


def init_source_fields(path: Path) -> dict:
    """The ModelConfig fields of an init_from source: a Hugging Face directory's config.json, or
    the model a meshlm checkpoint was trained with (its meta.json)."""
    if path.is_dir() and is_meshlm_checkpoint(path):
        from meshlm.train.checkpoint.store import CheckpointError, read_meta

        try:
            saved = read_meta(path)["model"]
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.init_from: {path}: not a readable meshlm checkpoint ({e})") from None
        shape_keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
                      "rope_theta", "tie_embeddings", "norm_eps")
        # the rope scaling keys: a checkpoint from before they existed was trained without scaling
        from meshlm.config import ROPE_SCALING_KEYS

        scaling = {k: saved.get(k) for k in ROPE_SCALING_KEYS}
        return {**{k: saved[k] for k in shape_keys}, "rope_scaling": saved.get("rope_scaling") or "none", **scaling}
    return model_fields_from_hf(read_llama_config(path), path)


def take_init_source(cfg) -> None:
    """model.init_from: the source's shape becomes the model's, and its tokenizer (if it has one)
    the data's unless data.tokenizer names another. An override that contradicts the source is
    an error naming the key (model.norm_eps has a default, not None, so it is simply taken)."""
    source = init_source(Path(cfg.model.init_from))
    cfg.model.init_from = str(source)  # a run directory: its newest checkpoint, recorded in config.toml
    for name, value in init_source_fields(source).items():
        ours = getattr(cfg.model, name)
        if name != "norm_eps" and ours is not None and ours != value:
            raise ConfigError(f"model.{name}: {ours} contradicts model.init_from={source}, whose model has "
                              f"{name} = {value}; leave model.{name} unset")
        setattr(cfg.model, name, value)
    if cfg.data.tokenizer is None and (source / "tokenizer.json").is_file():
        cfg.data.tokenizer = str(source)


# --------------------------------------------------------------------------- weights


class HFReader:
    """Rectangles of a Hugging Face Llama's tensors, under meshlm's names: `read("model", name,
    rect, out)` like a checkpoint reader, so `load_weights` takes it unchanged. Only the slice
    asked for is read (safetensors slices lazily from the memory-mapped file), in the file's
    dtype, and converted to fp32 by the copy into `out`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handles: dict[str, object] = {}
        if (self.path / HF_INDEX).is_file():  # sharded: the index maps each tensor to its file
            weight_map = _load_json(self.path / HF_INDEX, "model.init_from").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConfigError(f"model.init_from: {self.path / HF_INDEX} has no weight_map")
            self.files = dict(weight_map)
        elif (self.path / HF_WEIGHTS).is_file():
            self.files = {name: HF_WEIGHTS for name in self._open(HF_WEIGHTS).keys()}
        else:
            raise ConfigError(f"model.init_from: {self.path} has neither {HF_WEIGHTS} nor {HF_INDEX} "
                              f"(meshlm reads safetensors weights only)")
        self.meta: dict = {}  # load_weights reads meta only for optimizer state, which HF has none of

    def _open(self, file: str):
        if file not in self._handles:
            if not (self.path / file).is_file():
                raise ConfigError(f"model.init_from: {self.path / file} is missing (listed in {HF_INDEX})")
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error type for a bad header
                raise ConfigError(f"model.init_from: {self.path / file}: not a safetensors file ({e})") from None
        return self._handles[file]

    def _source(self, name: str) -> str:
        """The stored tensor that holds meshlm tensor `name`. A tied model never asks for its head:
        meshlm lists the shared tensor once, as the embedding (pieces.py), as transformers does."""
        theirs = hf_name(name)
        if theirs not in self.files:
            raise ConfigError(f"model.init_from: {self.path} has no tensor {theirs} (meshlm's {name})")
        return theirs

    def shape(self, name: str) -> tuple[int, ...]:
        theirs = self._source(name)
        return tuple(self._open(self.files[theirs]).get_slice(theirs).get_shape())

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        """ConfigError naming the first tensor whose shape differs from config.json's model, or a
        stored tensor this Llama has no place for."""
        for name, shape in expected.items():
            stored = self.shape(name)
            if stored != tuple(shape):
                raise ConfigError(f"model.init_from: {self.path}: {hf_name(name)} has shape {list(stored)}, "
                                  f"the model of its {HF_CONFIG} needs {list(shape)}")
        known = {hf_name(name) for name in expected} | {HF_HEAD}  # a tied file may still store the head
        extra = sorted(k for k in self.files if k not in known and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            raise ConfigError(f"model.init_from: {self.path}: tensor {extra[0]} is not part of a Llama "
                              f"of this shape")

    def read(self, kind: str, name: str, rect: Rect, out: torch.Tensor) -> None:
        if kind != "model":
            raise KeyError(f"a Hugging Face model stores weights only, not {kind}")
        theirs = self._source(name)
        sliced = self._open(self.files[theirs]).get_slice(theirs)
        if len(sliced.get_shape()) == 1:  # a vector is one row of the 2-D view
            block = sliced[rect.col: rect.col + rect.cols].view(1, rect.cols)
        else:
            block = sliced[rect.row: rect.row + rect.rows, rect.col: rect.col + rect.cols]
        out.copy_(block)


def open_weights(path: Path, model_cfg):
    """A reader of the weights at `path` (Hugging Face or meshlm checkpoint), its shapes checked
    against `model_cfg`."""
    from meshlm.train.checkpoint.pieces import canonical_shapes, check_shapes
    from meshlm.train.checkpoint.store import CheckpointReader

    if is_meshlm_checkpoint(path):
        try:
            reader = CheckpointReader(path)
        except Exception as e:  # a bad manifest or rank-file header: say which, in one line
            raise ConfigError(f"model.init_from: {path}: not a readable meshlm checkpoint ({e})") from None
        check_shapes(reader, model_cfg)
        return reader
    reader = HFReader(path)
    reader.check_shapes(canonical_shapes(model_cfg))
    return reader
