"""Live tensor bytes phase by phase inside a training step, beside the memory model's walk.

The peak test (test_memory.py) compares one number per rank, the largest; a term of the model
that never sets the peak, or moves it by less than the tolerance, is not seen there. Here the
step is cut into the windows the model names (each forward, the loss, each backward, the gradient
reduction, the optimizer step), the trainer's own tracker gives each window's peak, and each is
compared with the model's point for that window, as bytes above the step's starting state: the
model state cancels, and what is left is the term the window is about.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshlm.analysis.memory import rank_points
from meshlm.analysis.memory_terms import boundary_bytes, rope_table_bytes

# The model's phases, grouped into the windows a probe can cut from outside the engines; a
WINDOW_OF_PHASE = {"forward": "forward", "loss": "loss", "loss backward": "backward",
                   "head backward": "backward", "block backward": "backward",
                   "embedding backward": "backward", "gradient reduction": "backward",
                   "weight gradients": "weight gradients", "optimizer step": "optimizer step"}


@dataclass
class Window:
    name: str
    start: int  # live bytes when it opened
    peak: int  # the most live bytes inside it


class PhaseProbe:
    """Cuts one trainer's measured steps into windows, from the trainer's own live-bytes tracker:
    the model's forward (hooks on the module the engine calls), the loss, every autograd backward,
    the gradient reduction (`finish_backward`) and the optimizer step (`clip_and_step`)."""

    def __init__(self, trainer) -> None:
        self.tracker = trainer.memory._cpu_tracker
        assert self.tracker is not None, "the probe reads the CPU tracker: train.track_memory=true on CPU"
        self.windows: list[Window] = []
        self._open: list[tuple[str, int, int]] = []  # (name, start, the outer peak so far)
        module = trainer.pipeline.stage if trainer.pipeline is not None else trainer.dp.module
        module.register_forward_pre_hook(lambda *a: self._enter("forward"), prepend=True)
        module.register_forward_hook(lambda *a: self._exit(), always_call=True)
        self._wrap(trainer, "loss_sum", "loss")
        self._wrap(trainer.dp, "finish_backward", "reduction")
        self._wrap(trainer.dp, "clip_and_step", "optimizer step")
        if trainer.pipeline is not None and trainer.pipeline.engine.weight_grads is not None:
            self._wrap(trainer.pipeline.engine.weight_grads, "flush", "weight gradients")
        backward = torch.autograd.backward

        def probed_backward(*args, **kwargs):
            with self._window("backward"):
                return backward(*args, **kwargs)

        self._backward = backward
        torch.autograd.backward = probed_backward  # Tensor.backward calls it too

    def close(self) -> None:
        torch.autograd.backward = self._backward

    def _enter(self, name: str) -> None:
        t = self.tracker
        if t.track_resizes:  # its count follows frees only at the next op: bring it up to date
            t._resum()
        self._open.append((name, t.live, t.peak))
        t.peak = t.live

    def _exit(self) -> None:
        t = self.tracker
        if t.track_resizes:
            t._resum()
        name, start, outer_peak = self._open.pop()
        if not self._open:  # a window inside another (a flush's backward) is part of it
            self.windows.append(Window(name, start, t.peak))
        t.peak = max(outer_peak, t.peak)

    @contextlib.contextmanager
    def _window(self, name: str):
        self._enter(name)
        try:
            yield
        finally:
            self._exit()

    def _wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            with self._window(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, wrapped)

    def step(self, trainer) -> list[Window]:
        """Run one (measured) training step; its outermost windows, in order."""
        self.windows = []
        trainer.train_step()
        return list(self.windows)


def predicted_windows(cfg, pp_rank: int, backend: str) -> tuple[int, list[tuple[str, int]]]:
    """(the step's starting bytes, [(window, the model's largest point in it)]) for one rank."""
    points = rank_points(cfg, pp_rank, backend)
    base = points[0][1]
    start = base.params_bytes + base.optimizer_bytes + base.master_bytes + rope_table_bytes(cfg)
    if pp_rank > 0:  # its first forward's input: a receive buffer, posted before the first window opens
        start += boundary_bytes(cfg)
    after = points[-1][0] - 1  # the instruction index of the reduction after the program
    windows: dict[tuple[int, str], int] = {}
    for at, point in points:
        name = "reduction" if at == after else WINDOW_OF_PHASE[point.phase]
        windows[(at, name)] = max(windows.get((at, name), 0), point.peak_bytes)
    return start, [(name, peak) for (_, name), peak in windows.items()]


def measure_windows(world: int, configs: list[tuple[str, ...]], corpus, run_dir) -> list[tuple[int, list[Window]]]:
    """On this rank, for each config: (pipeline rank, the windows of step 2, the first step with
    optimizer state). Run in every rank of a launch (meshlm.testing.run_ranks)."""
    from helpers import build_trainer, small_cfg

    out = []
    for extra in configs:
        trainer = build_trainer(small_cfg(corpus, run_dir, world, "train.track_memory=true", *extra))
        probe = PhaseProbe(trainer)
        try:
            probe.step(trainer)
            windows = probe.step(trainer)
        finally:
            probe.close()
        out.append((trainer.ctx.coord("pp"), windows))
    return out


def compare(cfg, backend: str, per_rank: list[tuple[int, list[Window]]]) -> list[tuple[int, str, int, int]]:
    """(pp rank, window, measured bytes above the step's start, predicted) for every window of
    every role, the ranks of a role taken at their largest (the model predicts the largest)."""
    roles: dict[int, list[list[Window]]] = {}
    for pp_rank, windows in per_rank:
        roles.setdefault(pp_rank, []).append(windows)
    rows = []
    for pp_rank, runs in sorted(roles.items()):
        start, predicted = predicted_windows(cfg, pp_rank, backend)
        # the flush runs when the next input is late: compared in order, apart from the rest
        predicted = sorted(predicted, key=lambda w: w[0] == "weight gradients")
        assert len({len(run) for run in runs}) == 1, "ranks of one role ran different windows"
        measured = [sorted(run, key=lambda w: w.name == "weight gradients") for run in runs]
        names = [w.name for w in measured[0]]
        assert names == [name for name, _ in predicted], (pp_rank, names, predicted)
        for i, (name, bytes_) in enumerate(predicted):
            above = max(run[i].peak - run[0].start for run in measured)
            rows.append((pp_rank, name, above, bytes_ - start))
    return rows
