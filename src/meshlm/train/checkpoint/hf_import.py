"""Weights from elsewhere into meshlm: `model.init_from` into a running trainer's sharded model
(each rank reads only what it owns) and `meshlm import` of a Hugging Face directory into a run
directory's `final/`. The readers are in hf.py (Hugging Face) and store.py (meshlm checkpoints).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meshlm.errors import ConfigError
from meshlm.train.checkpoint.hf import is_meshlm_checkpoint, open_weights
from meshlm.train.checkpoint.pieces import Rect


def init_from(trainer, path: Path) -> None:
    """Fill every rank's weights from `path` (collective), each rank reading what it owns. The
    optimizer is left fresh and the step at 0. A meshlm checkpoint is verified against its
    manifest first, all ranks hashing a share of its files."""
    path = Path(path)
    if is_meshlm_checkpoint(path):
        from meshlm.train.checkpoint.resume import verify_together
        from meshlm.train.checkpoint.store import CheckpointError

        problem = verify_together(path, trainer.comm, trainer.ctx)
        if problem:
            raise CheckpointError(f"model.init_from: {problem}")
    from meshlm.train.checkpoint.state import load_weights

    load_weights(trainer, open_weights(path, trainer.cfg.model), optimizer_state=False)
    trainer.step = 0


def import_hf(source: Path, run_dir: Path, replace: bool = False) -> tuple[Path, Path | None]:
    """`meshlm import`: a Hugging Face Llama directory as meshlm's `run_dir/final/` (weights under
    meshlm's names, its tokenizer, a config), which `meshlm generate` reads. To train from it,
    `model.init_from` reads the directory directly; this is for inspecting and sampling. A run
    directory that already holds a model (final/ or checkpoints, which generate would no longer
    pick) is refused unless `replace`; then its checkpoints move to `checkpoints.old-<time>` once
    final/ is written (left in place, `export RUN_DIR`, which takes the newest checkpoint first,
    and a `train` resuming in that directory would go on with the replaced model). Returns
    (final/, where the checkpoints went or None)."""
    from meshlm.config import load_config, resolve
    from meshlm.model import Llama
    from meshlm.train.checkpoint.pieces import as_2d
    from meshlm.train.checkpoint.store import list_checkpoints
    from meshlm.train.weights import save_final

    source, run_dir = Path(source), Path(run_dir)
    if not (source / "tokenizer.json").is_file():
        raise ConfigError(f"--hf: {source} has no tokenizer.json (meshlm's final/ directory carries its tokenizer)")
    held = [str(p) for p in (run_dir / "final", run_dir / "checkpoints") if p.exists()
            and (p.name == "final" or list_checkpoints(p))]
    if held and not replace:
        raise ConfigError(f"--out: {run_dir} already holds a model ({', '.join(held)}); the import would "
                          f"replace or shadow it: choose another --out, or pass --force")
    cfg = load_config(None)  # paths set directly: as `key=value` text, "1000" would parse as a number
    cfg.model.init_from, cfg.run.dir = str(source), str(run_dir)
    seq_len, cfg.train.seq_len = cfg.train.seq_len, 1  # nothing is trained: no window to check
    try:
        cfg = resolve(cfg)
        reader = open_weights(source, cfg.model)
    except ConfigError as e:  # the user named the directories --hf and --out, not model.init_from, run.dir
        raise ConfigError(str(e).replace("model.init_from:", "--hf:", 1).replace("run.dir:", "--out:", 1)) from None
    cfg.train.seq_len = min(seq_len, cfg.model.max_seq_len)
    model = Llama(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is the embedding: listed once
            rows, cols = as_2d(tuple(p.shape))
            reader.read("model", name, Rect(0, 0, rows, cols), p.view(rows, cols))
    from meshlm.train.run_lock import run_dir_lock

    run_dir.mkdir(parents=True, exist_ok=True)
    try:  # a train running there would have its final/ replaced and its checkpoints moved under it
        with run_dir_lock(run_dir):
            final = save_final(model.state_dict(), cfg, source / "tokenizer.json", run_dir)
            aside = None
            if list_checkpoints(run_dir / "checkpoints"):
                from meshlm.train.checkpoint.resume import aside_path

                aside = aside_path(run_dir / "checkpoints")
                os.replace(run_dir / "checkpoints", aside)
    except ConfigError as e:  # the lock's, naming run.dir: the user named --out
        raise ConfigError(str(e).replace("run.dir:", "--out:", 1)) from None
    return final, aside
