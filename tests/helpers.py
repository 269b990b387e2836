"""Pieces the test files share: the offline corpus, a small training config, the CLI runner, a
loader that gives data-parallel ranks different numbers of target tokens, and the plain PyTorch
training loop the trainer is compared with."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pydoc_data.topics

from meshlm.config import Config, load_config, resolve
from meshlm.train.data import TokenLoader
from meshlm.train.trainer import IGNORE_INDEX

GLOBAL_BATCH = 8


@contextlib.contextmanager
def poisoned_empty():
    """`torch.empty` and `torch.empty_like` return NaN-filled floating tensors inside the block:
    code that reads memory it never wrote (an uninitialised gradient buffer read before every
    gradient arrived) then fails loudly instead of passing on whatever the allocator handed back,
    which on a fresh page happens to be zeros."""
    import torch

    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() and not t.is_meta else t

    def empty(*args, **kwargs):
        # A `with torch.device(...)` block only reaches the real torch.empty by name: pass its device on.
        if kwargs.get("device") is None:
            kwargs["device"] = torch.get_default_device()
        return poison(real_empty(*args, **kwargs))

    with mock.patch.object(torch, "empty", empty), \
            mock.patch.object(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k))):
        yield


def host_memory_tuning_recorder(monkeypatch, tmp_path: Path):
    """Records which processes apply train/host_memory.py's malloc tuning (a benchmark's forked ranks
    inherit the patch and append their pid to a file); returns a function giving the set of pids.
    Benchmarks must set their CPU ranks up as `meshlm train` does, or the side that allocates more
    per step pays page faults the other does not, and the ratio measures the allocator."""
    from meshlm.train import host_memory

    log, real = tmp_path / "host-memory-tuned.pids", host_memory.keep_freed_host_memory

    def recording() -> bool:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real()

    monkeypatch.setattr(host_memory, "keep_freed_host_memory", recording)
    return lambda: set(log.read_text().split()) if log.exists() else set()


def write_offline_corpus(root: Path) -> Path:
    """~0.5 MB of English from the standard library's documentation: no network in tests."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "topics.txt").write_text("\n\n".join(pydoc_data.topics.topics.values()))
    return root


def data_args(corpus: Path) -> list[str]:
    return [f"data.path={corpus / 'topics.txt'}", f"data.cache_dir={corpus / 'cache'}"]


def small_train_args(corpus: Path, run_dir: Path, steps: int = 5) -> list[str]:
    """The debug model on the offline corpus: a few fast steps at a modest lr.

    lr 1e-3: Adam divides by sqrt(v), so an element whose gradient is ~eps turns a 1e-9
    difference in summation order into a relative change of its update; the 1e-5 parameter
    tolerance is meant relative to updates of realistic size."""
    return ["model.preset=debug", *data_args(corpus), "train.seq_len=32", f"train.global_batch_size={GLOBAL_BATCH}",
            "train.micro_batch_size=2", "train.warmup_steps=2", f"train.steps={steps}", "train.lr=1e-3",
            "train.eval_interval=0", f"run.dir={run_dir}", "train.track_memory=false"]


def small_cfg(corpus: Path, run_dir: Path, world_size: int = 1, *extra: str, steps: int = 5) -> Config:
    return resolve(load_config(None, [*small_train_args(corpus, run_dir, steps), *extra]), world_size=world_size)


def run_meshlm(*args: str, timeout: float = 240, in_process: bool = False) -> subprocess.CompletedProcess:
    """`meshlm ARGS` in a subprocess (the real CLI and launch path), or with `in_process` through
    meshlm.cli.main in this process (`meshlm_in_process`); fails the test on exit != 0."""
    if in_process:
        return meshlm_in_process(*args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def meshlm_in_process(*args: str, code: int | None = 0) -> subprocess.CompletedProcess:
    """`meshlm ARGS` through meshlm.cli.main in this process, stdout and stderr captured into what
    `run_meshlm` returns. A one-rank `meshlm train` runs the same code as in a subprocess (cmd_train
    trains in the launcher's own process when the world is one rank), as do generate and export,
    without the seconds a new interpreter takes to import torch and meshlm (a 6-step run: ~6 s in a
    subprocess, under 1 s here). Not for several ranks, a signal or a crash: those need processes
    of their own. `code`: the exit status to assert (None: any).

    Each call must leave this process as it found it (`_process_state`): later tests run here.
    glibc malloc is not tuned (train.keep_host_memory): mallopt cannot be undone, and the ranks
    later tests fork would inherit it."""
    from meshlm.cli import main

    before, handlers = _process_state(), _meshlm_log_handlers()
    out, err = io.StringIO(), io.StringIO()
    with mock.patch("meshlm.train.worker.keep_freed_host_memory", lambda: False), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            returncode = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            returncode = e.code if isinstance(e.code, int) else 1
    _close_new_log_handlers(handlers)  # a subprocess's would close at exit; a resumed run reopens its log
    proc = subprocess.CompletedProcess(["meshlm", *args], returncode, out.getvalue(), err.getvalue())
    if code is not None:
        assert returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    after = _process_state(before["threads"])
    assert after == before, {k: _changes(before[k], after[k]) for k in before if before[k] != after[k]}
    return proc


def _changes(before, after):
    if isinstance(before, dict):
        return {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return before, after


def _process_state(threads_before: frozenset | None = None) -> dict:
    """What a run in this process could change and leave changed for the tests after it. Given the
    threads from before the run, the ones it started get a few seconds to end (a background
    checkpoint save finishing)."""
    import faulthandler

    import torch

    if threads_before is not None:
        _join_new_threads(threads_before, timeout=5)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)
    return {"threads": _our_threads(),
            "signals": {s: signal.getsignal(s) for s in handled}, "faulthandler": faulthandler.is_enabled(),
            "torch_threads": torch.get_num_threads(), "dtype": torch.get_default_dtype(),
            "grad": torch.is_grad_enabled(), "cwd": os.getcwd(),
            "env": {k: v for k, v in os.environ.items() if k not in LIBRARY_ENV}}


# What libraries set up once per process and keep, whoever used them first: torch's cache path,
# set when its compiler is first imported; tqdm's monitor thread, started with the first bar.
LIBRARY_ENV = {"TORCHINDUCTOR_CACHE_DIR"}
LIBRARY_THREADS = {"tqdm_monitor"}


def _our_threads() -> frozenset:
    return frozenset((t.ident, t.name) for t in threading.enumerate() if t.is_alive() and t.name not in LIBRARY_THREADS)


def _join_new_threads(before: frozenset, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if (thread.ident, thread.name) not in before and thread.name not in LIBRARY_THREADS:
            thread.join(max(0.0, deadline - time.monotonic()))


def _meshlm_log_handlers() -> dict[str, list]:
    loggers = logging.root.manager.loggerDict
    return {name: list(lg.handlers) for name, lg in loggers.items()
            if name.startswith("meshlm") and isinstance(lg, logging.Logger)}


def _close_new_log_handlers(before: dict[str, list]) -> None:
    """The rank log files (logs/rankN.log) the run opened."""
    for name, handlers in _meshlm_log_handlers().items():
        for handler in handlers:
            if handler not in before.get(name, []):
                handler.close()
                logging.getLogger(name).removeHandler(handler)


def no_rank_left(run_dir: Path) -> None:
    """No worker process of the run in `run_dir` outlives its launcher (within 10 s)."""
    deadline = time.time() + 10
    while time.time() < deadline:  # the trailing /: this run's workers, not those of runs/x2 for runs/x
        found = subprocess.run(["pgrep", "-f", f"meshlm.train.worker --config {run_dir}/"], capture_output=True)
        if found.returncode != 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"rank processes still running: {found.stdout.decode()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


class UnevenlyMaskedLoader(TokenLoader):
    """Masks a different number of leading targets in each sample of the global batch, so dp
    ranks and the micro-batches within a rank hold different target-token counts: a mean of
    per-micro-batch (or per-rank) means then differs from the global mean."""

    def _rows(self, step, start, count):
        inputs, targets = super()._rows(step, start, count)
        targets = targets.clone()
        for j in range(count):
            targets[j, : (7 * (start + j)) % targets.shape[1]] = IGNORE_INDEX
        return inputs, targets


def cli_train_args(corpus: Path, run_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    """`meshlm train` on the debug model for 4 steps with evals at 2 and 4; overrides win."""
    return ["train", "--nproc", str(nproc), "model.preset=debug", *data_args(corpus), "train.seq_len=32",
            f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=2", "train.steps=4", "train.lr=1e-3",
            "train.eval_interval=2", "run.sample_tokens=8", f"run.dir={run_dir}", *overrides]


def build_trainer(cfg: Config, loader_cls: type[TokenLoader] | None = None):
    """A Trainer on this rank (process group, if any, already up), metrics off; optionally with
    another loader class over the same tokens."""
    from meshlm.mesh import ParallelContext
    from meshlm.train.data import prepare_data
    from meshlm.train.trainer import Trainer

    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda m: None)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg.parallel), data)
    trainer.metrics.active = False
    if loader_cls is not None:
        t = cfg.train
        trainer.loader = loader_cls(data.train_tokens(), t.seq_len, t.global_batch_size, cfg.run.seed)
    return trainer


def debug_model(seed: int = 7, recompute: str = "none", **model_overrides):
    """The debug-preset Llama, initialised, for tests of engines that wrap any nn.Module;
    `model_overrides` as model.KEY=VALUE config keys (e.g. n_layers=3)."""
    from meshlm.model import Llama, init_weights
    from meshlm.parallel.recompute import apply_activation_checkpointing

    cfg = resolve(load_config(None, ["model.preset=debug", "train.micro_batch_size=1", "train.global_batch_size=1",
                                     *(f"model.{k}={v}" for k, v in model_overrides.items())]))
    model = Llama(cfg.model)
    init_weights(model, seed)
    apply_activation_checkpointing(model, recompute)
    return model


def local_batch(step: int, rank: int, n: int, vocab: int = 512, global_batch: int = 8, seq: int = 16):
    """Rank `rank`'s share of step `step`'s random global batch: (inputs, targets, global token count)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    share = global_batch // n
    rows = tokens[rank * share: (rank + 1) * share]
    return rows[:, :-1], rows[:, 1:], global_batch * seq


def plain_pytorch_reference(cfg: Config, loader_cls: type[TokenLoader] = UnevenlyMaskedLoader, n_steps: int = 3):
    """The trainer's reference, written from the spec with torch alone (no meshlm trainer,
    optimizer, schedule or loss code): the whole global batch in one forward, the mean of
    F.cross_entropy over the target tokens, clip_grad_norm_, torch's AdamW with decay on matrices
    only, linear warmup then cosine decay to min_lr_ratio * lr.

    Returns (gradients of step 0 before clipping, the loss of each step, parameters after
    n_steps). Only the model and the sample order come from meshlm: the model is compared with
    transformers' Llama in test_model.py, the sample order is the data contract."""
    import math

    import torch
    import torch.nn.functional as F

    from meshlm.model import Llama, init_weights

    t = cfg.train
    loader = _loader(cfg, loader_cls)
    model = Llama(cfg.model)
    init_weights(model, cfg.run.seed)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    gains = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                                   {"params": gains, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2),
                                  eps=t.eps)

    def lr(step):
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = min(1.0, (step + 1 - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    grads, losses = None, []
    for step in range(n_steps):
        inputs, targets = loader.global_batch(step)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        if t.grad_clip > 0:  # 0 is clipping off (torch's max_norm=0 would zero every gradient)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads, losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def target_counts(cfg: Config, loader_cls: type[TokenLoader], dp_size: int, step: int = 0) -> list[list[int]]:
    """Target tokens per micro-batch of each dp rank at `step`: the evidence that a test with
    `loader_cls` really has uneven counts."""
    loader, micro = _loader(cfg, loader_cls), cfg.train.micro_batch_size
    return [[int((tgt != IGNORE_INDEX).sum()) for _, tgt in loader.microbatches(step, r, dp_size, micro)]
            for r in range(dp_size)]


def _loader(cfg: Config, loader_cls: type[TokenLoader]) -> TokenLoader:
    from meshlm.train.data import prepare_data

    t = cfg.train
    tokens = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda m: None).train_tokens()
    return loader_cls(tokens, t.seq_len, t.global_batch_size, cfg.run.seed)


def pp2_engine(defer: bool = False):
    """(engine, stage) of this forked rank in a pp=2 pipeline of a 2-layer debug model."""
    from meshlm.bench.pp import build_stage
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.pipeline.engine import PipelineEngine
    from meshlm.parallel.pipeline.p2p import PipelineP2P

    ctx = ParallelContext(Layout(pp=2))
    cfg = resolve(load_config(None, ["model.preset=debug", "model.n_layers=2", "train.seq_len=16", "parallel.pp=2"]),
                  world_size=2)
    stage, _ = build_stage(cfg, 2, ctx.rank, 1, ctx.device)
    return PipelineEngine(stage, PipelineP2P(Comm(ctx)), defer_weight_grads=defer), stage


def pp2_microbatches(n: int = 4):
    """n micro-batches [(inputs, targets)] of one row of 16 tokens each (seed 0)."""
    import torch

    tokens = torch.randint(0, 512, (n, 17), generator=torch.Generator().manual_seed(0))
    return list(zip(tokens[:, :-1].chunk(n), tokens[:, 1:].chunk(n)))


def comm_here():
    """A traced Comm over this process's world (the forked test ranks'), every rank on dp."""
    from meshlm.comm import Comm
    from meshlm.mesh import ParallelContext

    return Comm(ParallelContext.from_config(load_config(None, []).parallel))


def train_any_module(model, x, sharded: bool, policy, train_cfg, steps: int = 3):
    """`steps` AdamW steps on sum(model(x)²): on one process over all rows of x, or under meshlm's
    FSDP with `policy`, each rank taking its share of the rows (the sum over ranks is the same
    loss). Returns (full state dict, the FSDP engine or None)."""
    import torch.distributed as dist

    from meshlm.parallel.fsdp import FullyShardedDataParallel
    from meshlm.train.optim import build_optimizer

    if not sharded:
        optimizer = build_optimizer(model, train_cfg)
        for _ in range(steps):
            model(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, None
    fsdp = FullyShardedDataParallel(model, comm_here(), train_cfg, policy=policy)
    rank, n, rows = dist.get_rank(), dist.get_world_size(), x.shape[0]
    for _ in range(steps):
        fsdp.module(x[rank * rows // n: (rank + 1) * rows // n]).pow(2).sum().backward()
        fsdp.finish_backward()
        fsdp.clip_and_step(train_cfg.lr, 0.0)
        fsdp.zero_grad()
    return fsdp.full_state_dict(), fsdp
