"""The trained model as a self-contained directory: weights (safetensors), tokenizer, config.

`run.dir/final/` is the portable end product of a run. `meshlm generate` reads it, or a sharded
checkpoint directory (`run.dir/checkpoints/step_NNNNNNN/`, any layout: the reader assembles the
full tensors); `find_trained` says which of the two a path names.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from meshlm.config import Config, ConfigError, load_config, resolve
from meshlm.config_toml import to_toml
from meshlm.model import Llama
from meshlm.train.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG

WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
CONFIG = "config.toml"


def save_final(state_dict: dict[str, torch.Tensor], cfg: Config, tokenizer_path: Path, run_dir: Path) -> Path:
    """Write the full (unsharded) weights to `run_dir/final/` atomically: into a temp dir, then
    one rename, so a crash never leaves a half-written model where a good one was. Durably, as a
    checkpoint (durable.py): after a power loss the rename alone could name files of zeros."""
    from meshlm.durable import fsync_dir, fsync_file

    model = Llama(cfg.model)
    model.load_state_dict({k: v.detach().cpu() for k, v in state_dict.items()})
    final = run_dir / "final"
    tmp = run_dir / "final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_model drops the duplicate of tied weights (safetensors stores no aliases).
    save_model(model, str(tmp / WEIGHTS))
    shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
    for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):  # its end-of-text choice (run_end_token), its chat
        if (Path(tokenizer_path).parent / name).is_file():  # template (tokenizer.chat_template): for exports
            shutil.copyfile(Path(tokenizer_path).parent / name, tmp / name)
    (tmp / CONFIG).write_text(to_toml(cfg))
    for written in tmp.iterdir():
        fsync_file(written)
    fsync_dir(tmp)
    old = run_dir / "final.old"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _is_final(path: Path) -> bool:
    return (path / WEIGHTS).exists() and (path / TOKENIZER).exists()


def find_trained(path: str | Path, prefer: str = "final", key: str = "--checkpoint") -> tuple[str, Path]:
    """("final", dir) or ("checkpoint", dir) for `path`: a final/ directory, a checkpoint directory,
    or a run directory (its final/ or its newest good checkpoint, `prefer` first). ConfigError if
    there is nothing there; CheckpointError if its checkpoints are corrupt (hashes checked)."""
    from meshlm.train.checkpoint.store import CheckpointError, list_checkpoints, newest_good, verify

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{key}: {path} is not a directory")
    if (path / "manifest.json").is_file() or (path / "meta.json").is_file():  # one checkpoint
        problem = verify(path)
        if problem:
            raise CheckpointError(problem)
        return "checkpoint", path
    if _is_final(path):
        return "final", path

    def newest_checkpoint() -> Path | None:
        root = next((r for r in (path / "checkpoints", path) if list_checkpoints(r)), None)
        return None if root is None else newest_good(root, verify, lambda m: print(f"meshlm: warning: {m}", file=sys.stderr))

    order = ("final", "checkpoint") if prefer == "final" else ("checkpoint", "final")
    for kind in order:
        found = (path / "final" if _is_final(path / "final") else None) if kind == "final" else newest_checkpoint()
        if found is not None:
            _warn_if_newer(path, kind, found, key)
            return kind, found
    raise ConfigError(f"{key}: {path} holds no checkpoint (no checkpoints/step_*/ and no final/ with {WEIGHTS})")


def _warn_if_newer(run_dir: Path, kind: str, found: Path, key: str) -> None:
    """Warn when final/ is taken from run directory `run_dir` but a later checkpoint exists: a run
    resumed with more steps after final/ was written that stopped before finishing (preempted,
    failed) leaves final/ behind its newest checkpoint, and generate (final/ first) and export
    (checkpoint first) would take different weights without a word; so does a run resumed from
    an older checkpoint (the newer ones set aside) that stopped before finishing. Later: written
    after final/, at another step than the train.steps final/ was written at (at that step it is
    the run's own last checkpoint, which may finish after final/ or be copied after it)."""
    from meshlm.train.checkpoint.store import MANIFEST, STEP_DIR, list_checkpoints

    if kind != "final":
        return
    complete = [p for p in list_checkpoints(run_dir / "checkpoints") if (p / MANIFEST).is_file()]
    if not complete:
        return
    newest = complete[-1]
    try:
        final_steps = load_config(str(found / CONFIG)).train.steps
        later = (int(STEP_DIR.match(newest.name).group(1)) != final_steps
                 and (newest / MANIFEST).stat().st_mtime > (found / WEIGHTS).stat().st_mtime)
    except (OSError, ConfigError):
        return
    if later:
        print(f"meshlm: warning: using {found} (step {final_steps}), but checkpoint {newest} was written "
              f"after it; pass {key} {newest} to use that one", file=sys.stderr)


def _inference_config(config_file: Path) -> Config:
    """A saved run config, resolved for the layout it trained with, with what only training
    needs removed: the corpus or blend and init_from may be gone by now. The tokenizer is the
    one saved beside the weights (a small pretrained one passes the checks only as itself)."""
    cfg = load_config(str(config_file))
    cfg.data.path = cfg.data.blend = cfg.model.init_from = None
    cfg.data.tokenizer = str(config_file.parent / TOKENIZER)
    p = cfg.parallel
    return resolve(cfg, world_size=p.dp * p.tp * p.cp * p.pp)


def load_checkpoint_model(checkpoint: Path, cfg: Config) -> Llama:
    """The single-process model with the full weights of checkpoint `checkpoint` (any layout)."""
    from meshlm.train.checkpoint.pieces import canonical_shapes
    from meshlm.train.checkpoint.pieces import check_shapes
    from meshlm.train.checkpoint.store import CheckpointReader

    reader = CheckpointReader(checkpoint)
    check_shapes(reader, cfg.model)
    model = Llama(cfg.model)
    # A tied head is one parameter listed once (as the embedding), so loading that fills both.
    state = {name: reader.full("model", name) for name in canonical_shapes(cfg.model)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"output.weight"} if cfg.model.tie_embeddings else set()), missing
    return model


def open_trained(path: str | Path, open_found, prefer: str = "final", tries: int = 3):
    """`open_found(kind, dir)` of what `find_trained(path, prefer)` names. A train still running in
    run directory `path` saves and deletes checkpoints meanwhile (checkpoint.keep): one deleted
    between being found and being open fails, and is looked for again while the directory's
    checkpoints keep changing. `open_found` must leave nothing to read from the directory later
    (small files copied, rank files mapped): a deletion after it returns changes nothing."""
    from meshlm.train.checkpoint.store import CheckpointError, list_checkpoints

    path = Path(path)
    listing = lambda: [list_checkpoints(root) for root in (path / "checkpoints", path)]  # noqa: E731
    for attempt in range(tries):
        before = listing()
        try:
            return open_found(*find_trained(path, prefer=prefer))
        except (CheckpointError, ConfigError, OSError):
            if attempt == tries - 1 or listing() == before:
                raise
    raise AssertionError("unreachable")


def held_copy(src: Path, names) -> tempfile.TemporaryDirectory:
    """A temporary copy of `src`'s small files `names` (those present): what a deletion of `src`
    while it is read must not take away."""
    held = tempfile.TemporaryDirectory(prefix="meshlm-held-")
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, Path(held.name) / name)
    return held


def load_trained(path: str | Path, device: torch.device | str = "cpu"):
    """(model in eval mode, tokenizer, config, end-of-text id) from a final/ directory written by
    `save_final`, a checkpoint directory, or a run directory (its final/, else its newest good
    checkpoint)."""
    from meshlm.train.tokenizer import load_tokenizer, run_end_token

    def load(kind: str, model_dir: Path):
        with held_copy(model_dir, (CONFIG, TOKENIZER, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE)) as held:
            cfg = _inference_config(Path(held) / CONFIG)
            tokenizer, end_id = load_tokenizer(Path(held) / TOKENIZER), run_end_token(Path(held) / TOKENIZER)[1]
            if kind == "checkpoint":
                model = load_checkpoint_model(model_dir, cfg)
            else:
                model = Llama(cfg.model)
                load_model(model, str(model_dir / WEIGHTS))
        cfg.data.tokenizer = str(model_dir / TOKENIZER)
        return model.to(device).eval(), tokenizer, cfg, end_id

    return open_trained(path, load)
