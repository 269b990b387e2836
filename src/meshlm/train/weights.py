"""The trained model as a self-contained directory: weights (safetensors), tokenizer, config.

`run.dir/final/` is what `meshlm generate` reads. The checkpoint issue adds sharded, resumable
checkpoints next to it; this is the portable end product of a run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from meshlm.config import Config, ConfigError, load_config, resolve, to_toml
from meshlm.model import Llama

WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
CONFIG = "config.toml"


def save_final(state_dict: dict[str, torch.Tensor], cfg: Config, tokenizer_path: Path, run_dir: Path) -> Path:
    """Write the full (unsharded) weights to `run_dir/final/` atomically: into a temp dir, then
    one rename, so a crash never leaves a half-written model where a good one was."""
    model = Llama(cfg.model)
    model.load_state_dict({k: v.detach().cpu() for k, v in state_dict.items()})
    final = run_dir / "final"
    tmp = run_dir / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_model drops the duplicate of tied weights (safetensors stores no aliases).
    save_model(model, str(tmp / WEIGHTS))
    shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
    (tmp / CONFIG).write_text(to_toml(cfg))
    old = run_dir / "final.old"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find_model_dir(path: str | Path) -> Path:
    """Accept a run directory or its `final/` directory."""
    path = Path(path)
    for candidate in (path, path / "final"):
        if (candidate / WEIGHTS).exists() and (candidate / TOKENIZER).exists():
            return candidate
    raise ConfigError(f"--checkpoint: no {WEIGHTS} + {TOKENIZER} in {path} or {path / 'final'}")


def load_trained(path: str | Path, device: torch.device | str = "cpu"):
    """(model in eval mode, tokenizer, config) from a directory written by `save_final`."""
    from meshlm.train.tokenizer import load_tokenizer

    model_dir = find_model_dir(path)
    cfg = load_config(str(model_dir / CONFIG))
    p = cfg.parallel  # the saved config is resolved for the layout it trained with
    cfg = resolve(cfg, world_size=p.dp * p.tp * p.cp * p.pp)
    model = Llama(cfg.model)
    load_model(model, str(model_dir / WEIGHTS))
    model.to(device).eval()
    return model, load_tokenizer(model_dir / TOKENIZER), cfg
