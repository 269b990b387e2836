"""Which checkpoint a run continues from: `checkpoint.resume` = auto | never | a path.

Two passes. Before any rank starts, the launcher checks what it can cheaply (the path is a
checkpoint, its model and data settings fit this config) and exits 2 with one line if not.
Then the ranks choose together: every rank hashes a share of the candidate's files, and a
checkpoint with any mismatch is skipped with a warning naming the file (auto) or is an error
(an explicit path). A torchrun restart after a failure always resumes (`auto`), whatever the
setting: that is what the restart is for.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meshlm.config import ROPE_SCALING_KEYS, Config, ConfigError
from meshlm.train.checkpoint.store import (META, CheckpointError, CheckpointReader, list_checkpoints, newest_good,
                                           read_manifest, verify, verify_files)


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.run.dir) / "checkpoints"


def is_restart() -> bool:
    """torchrun restarted this worker group after a failure (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def explicit_candidates(path: Path) -> list[Path]:
    """A checkpoint directory, or a run directory / its checkpoints/ (then its checkpoints, oldest first)."""
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found and not (path / "manifest.json").exists():
            return found
    return [path]


def check_compatible(path: Path, cfg: Config, warn) -> None:
    """ConfigError (one line) if checkpoint `path` cannot continue this config's training."""
    from meshlm.train.checkpoint.pieces import check_shapes

    reader = CheckpointReader(path)
    check_shapes(reader, cfg.model)
    saved = reader.meta.get("model", {})
    for key in ("n_heads", "n_kv_heads"):  # the same weight shapes can be cut into other heads
        if key in saved and saved[key] != getattr(cfg.model, key):
            raise ConfigError(f"model.{key}: {getattr(cfg.model, key)}, but checkpoint {path} was trained with "
                              f"{saved[key]} (the weights have the same shapes, split into other heads)")
    for key in ("rope_scaling", *ROPE_SCALING_KEYS):  # a checkpoint from before these keys: no scaling
        theirs = saved.get(key)
        if theirs is None and key == "rope_scaling":
            theirs = "none"
        if theirs != getattr(cfg.model, key):
            raise ConfigError(f"model.{key}: {getattr(cfg.model, key)}, but checkpoint {path} was trained with "
                              f"{theirs} (other rope frequencies: the same weights would compute another function)")
    changed = [f"model.{k} {saved[k]} -> {getattr(cfg.model, k)}" for k in ("rope_theta", "norm_eps")
               if k in saved and saved[k] != getattr(cfg.model, k)]
    if changed:
        warn(f"meshlm: warning: resuming {path.name} with {', '.join(changed)}: the same weights compute "
             f"another function")
    data = reader.meta["data"]
    for key, ours in (("seed", cfg.run.seed), ("seq_len", cfg.train.seq_len),
                      ("global_batch_size", cfg.train.global_batch_size)):
        if data[key] != ours:
            section = "run" if key == "seed" else "train"
            raise ConfigError(f"{section}.{key}: {ours}, but checkpoint {path} was trained with {data[key]}; "
                              f"resuming would not replay the same batches")
    _warn_if_schedule_changed(path, cfg, warn)  # last: only a resume that goes ahead warns


def _warn_if_schedule_changed(path: Path, cfg: Config, warn) -> None:
    """A resume may change the schedule (e.g. more steps), but then the curve is not the one the
    saved run would have followed: say so, naming the keys."""
    from meshlm.config import load_config

    saved = load_config(str(path / "config.toml")).train
    changed = [f"train.{k} {getattr(saved, k)} -> {getattr(cfg.train, k)}"
               for k in ("steps", "lr", "warmup_steps", "min_lr_ratio", "lr_decay", "decay_fraction", "weight_decay",
                         "beta1", "beta2", "grad_clip")
               if getattr(saved, k) != getattr(cfg.train, k)]
    if changed:
        warn(f"meshlm: warning: resuming {path.name} with another schedule ({', '.join(changed)}): the curve "
             f"continues from the checkpoint but is not the saved run's")


def precheck(cfg: Config, warn=print) -> Path | None:
    """The launcher's check (no hashing): the checkpoint a run will most likely continue from,
    or None. ConfigError if the requested one is not a checkpoint or does not fit the model. Where
    the ranks would fall back to an older checkpoint (auto, or a run directory), so does this."""
    mode = cfg.checkpoint.resume
    if mode == "never":
        return None
    if mode == "auto":
        candidates, fall_back = list_checkpoints(checkpoint_root(cfg)), True
    else:
        path = Path(mode)
        if not path.exists():
            raise ConfigError(f"checkpoint.resume: {path} does not exist")
        candidates = explicit_candidates(path)
        fall_back = len(candidates) > 1
    for path in reversed(candidates):
        problem = _small_files_problem(path)
        if problem is None:
            try:
                check_compatible(path, cfg, warn)
                return path
            except CheckpointError as e:  # a rank file's header unreadable, or missing
                problem = str(e)
            except ConfigError as e:
                if mode != "auto":
                    raise
                raise ConfigError(f"{e}; run.dir={cfg.run.dir} holds another run's checkpoints: use "
                                  f"checkpoint.resume=never or another run.dir") from None
        if not fall_back:
            raise ConfigError(f"checkpoint.resume: {problem}")
        warn(f"meshlm: warning: skipping checkpoint {path.name}: {problem}")  # the ranks fall back the same way
    return None


def check_same_data(path: Path | None, data, cfg: Config) -> None:
    """ConfigError (one line) if checkpoint `path` was trained on other data than `data` (this
    run's PreparedData): another corpus or blend, other weights, or a cache key that changed (the
    corpus content, tokenizer, vocabulary or data.val_fraction). Its loader position would be
    replayed over other windows: not a resume. The launcher calls it once the cache is prepared,
    before any rank starts; a checkpoint from before the loader recorded its data is not checked."""
    from meshlm.data.blend import data_sources
    from meshlm.train.data import describe_sampling, describe_sources, same_sources

    if path is None:
        return
    state = CheckpointReader(path).meta["data"]
    saved = state.get("sources")
    ours = data_sources(data)
    key = "data.blend" if cfg.data.blend is not None else "data.path"
    if saved is not None and not same_sources(saved, ours):
        raise ConfigError(f"{key}: checkpoint {path} was trained on {describe_sources(saved)}, this run reads "
                          f"{describe_sources(ours)} (another corpus or blend, or its content, tokenizer, vocabulary "
                          f"or data.val_fraction changed); resuming would not replay the same batches: use the "
                          f"same data, or checkpoint.resume=never")
    sampling = "blend" if data.parts else "windows"  # a blend of one corpus has that corpus's sources
    if state.get("sampling", sampling) != sampling:
        raise ConfigError(f"{key}: checkpoint {path} was trained on {describe_sources(saved)} "
                          f"{describe_sampling(state['sampling'])}, this run reads it {describe_sampling(sampling)}, "
                          f"which orders its samples otherwise; resuming would not replay the same batches: use "
                          f"the same setting, or checkpoint.resume=never")


def _small_files_problem(path: Path) -> str | None:
    """A manifest, and a meta.json that matches it: what the launcher reads (no tensor is hashed)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return str(e)
    if META not in manifest["files"]:
        return f"{path}/manifest.json: lists no {META}"
    return verify_files(path, [META], manifest)


def verify_together(path: Path, comm, ctx) -> str | None:
    """Every rank hashes every world_size-th file; all agree on the verdict. Rank 0 re-checks a
    bad checkpoint alone to name the file (the rare path)."""
    problem = verify(path, (ctx.rank, ctx.world_size))
    bad = torch.tensor([1.0 if problem else 0.0], device=ctx.device)
    comm.all_reduce(bad, "world", op=torch.distributed.ReduceOp.MAX)
    if bad.item() == 0:
        return None
    return problem or verify(path) or "a file does not match its checksum (found by another rank)"


def choose(cfg: Config, comm, ctx, warn) -> Path | None:
    """The checkpoint every rank loads (collective), or None to start fresh. A restart continues
    from the run's own newest checkpoint, or, if it died before saving one, from where it was
    told to start."""
    mode = cfg.checkpoint.resume
    if is_restart() or mode == "auto":
        own = newest_good(checkpoint_root(cfg), lambda p: verify_together(p, comm, ctx), warn)
        if own is not None or mode in ("auto", "never"):
            return own
    if mode == "never":
        return None
    candidates = explicit_candidates(Path(mode))
    if len(candidates) > 1:  # a run directory: its newest good checkpoint
        return newest_good(candidates[0].parent, lambda p: verify_together(p, comm, ctx), warn)
    problem = verify_together(candidates[0], comm, ctx)
    if problem:
        raise CheckpointError(f"checkpoint.resume: {problem}")
    return candidates[0]


def set_aside_old_checkpoints(cfg: Config, loaded: Path | None) -> Path | None:
    """A run that does not continue from its directory's newest checkpoint starts another timeline:
    the checkpoints of the one it leaves move to `checkpoints.old-<time>` (never deleted), so they are
    never mixed with, rotated against, or later resumed in place of this run's. Returns that
    directory, or None if nothing moved. Rank 0 only, after every rank has loaded.

    - `loaded` is one of checkpoints/ (auto fell back past a bad newest one, or checkpoint.resume
      named an older one of this run): only the newer ones move. It and the older ones are this
      timeline's past, and a torchrun restart before this run's first save must find it where
      `choose` looks (moving it too made that restart start from step 0, or fail).
    - resume=never, or `loaded` from elsewhere: all of checkpoints/ moves; a restart before the
      first save finds `loaded` again where checkpoint.resume names it (`choose`)."""
    root = checkpoint_root(cfg)
    found = list_checkpoints(root)
    if not found:
        return None
    here = [p.resolve() for p in found]
    if loaded is not None and loaded.resolve() in here:
        newer = found[here.index(loaded.resolve()) + 1:]
        if not newer:
            return None
        aside = aside_path(root)
        aside.mkdir()
        # One rename each (no single rename moves part of a directory), newest first: the one
        # auto would otherwise resume in place of this run's goes first.
        for path in reversed(newer):
            os.replace(path, aside / path.name)
        return aside
    aside = aside_path(root)
    os.replace(root, aside)
    return aside


def aside_path(root: Path) -> Path:
    """`checkpoints.old-<time>`, or `...-2`, `-3` if taken: two set-asides within one second (two
    fresh starts in a row) would otherwise rename onto the first's, and a rename onto a non-empty
    directory fails. The run directory's lock (run_lock.py) keeps other trains out between the
    check and the rename."""
    import time

    stamp = root.with_name(f"{root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    aside, n = stamp, 1
    while aside.exists():
        n += 1
        aside = stamp.with_name(f"{stamp.name}-{n}")
    return aside

