"""Per-rank peak memory of a training step, measured: CUDA's allocator statistics on GPU, and on
CPU a count of live tensor bytes (peak RSS is useless here: the allocator keeps freed pages).

On CPU every aten op passes through a TorchDispatchMode that notes each new storage and a weak
reference that subtracts its bytes when the storage dies. That costs Python time per op (up to
half the step under ZeRO-3, whose resized storages must be re-summed), so on CPU the peak is
measured on the first two steps a process runs (1 and 2, or the two after the step a run resumed
from) and every `train.memory_interval`-th step, exact on those, and the
other steps report the last measured value (`mem_measured` says which); `memory_interval=1`
measures every step, `train.track_memory=false` none. On CUDA the allocator's statistics cost
nothing and every step is measured.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory on this rank: a DTensor's local shard, or the result inside a
    not-yet-waited functional collective."""
    t = getattr(t, "_local_tensor", t)  # DTensor
    if type(t).__name__ == "AsyncCollectiveTensor":
        t = t.elem
    return t


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created inside the mode, plus any registered with
    `track`; `peak` is the high-water mark since the last `reset_peak`.

    `track_resizes=True` also follows storages that change size in place (FSDP frees a unit's
    gathered parameters with `storage.resize_(0)`, which is no aten op): it re-sums the current
    size of every storage seen, as input or output, after each op. Exact, but slower."""

    def __init__(self, track_resizes: bool = False) -> None:
        super().__init__()
        self.track_resizes = track_resizes
        self._sizes = WeakIdKeyDictionary()
        self._refs: set[weakref.ref] = set()
        self.live = 0
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._note(t)
        if self.track_resizes:
            self._resum()

    def reset_peak(self) -> None:
        self.peak = self.live

    def _note(self, t: torch.Tensor) -> None:
        t = _plain(t)
        if t.is_meta or t.device.type != "cpu":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return
        if storage in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[storage] = nbytes
        if self.track_resizes:
            return  # `_resum` recounts everything after the op
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def freed(ref: weakref.ref, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._refs.discard(ref)

        self._refs.add(weakref.ref(storage, freed))

    def _resum(self) -> None:
        self.live = sum(storage.nbytes() for storage in list(self._sizes.keys()))
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out) if self.track_resizes else out):
            if isinstance(t, torch.Tensor):
                self._note(t)
        if self.track_resizes:
            self._resum()
        return out


def measure_peak_bytes(fn, state_tensors: Iterable[torch.Tensor], device: torch.device,
                       track_resizes: bool = False) -> int:
    """Peak bytes on this rank while `fn()` runs, counting `state_tensors` (already live) and
    nothing else that exists before: so two models alive side by side (a benchmark alternating
    meshlm and its reference) are each measured alone."""
    state = list(state_tensors)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        storages = {_plain(t).untyped_storage().data_ptr(): _plain(t).untyped_storage() for t in state}
        mine = sum(s.nbytes() for s in storages.values())
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        return int(torch.cuda.max_memory_allocated(device) - before + mine)
    tracker = LiveTensorBytes(track_resizes)
    tracker.track(state)
    tracker.reset_peak()
    with tracker:
        fn()
    return int(tracker.peak)


class PeakMemory:
    """Measures the peak bytes of each training step on this rank, on CPU or CUDA alike.

    Usage: `with meter.step(state_tensors): ...` then read `meter.last_peak` (None if disabled).
    """

    def __init__(self, device: torch.device, enabled: bool = True, track_resizes: bool = False,
                 interval: int = 1) -> None:
        self.device = device
        self.enabled = enabled
        self.interval = interval  # CPU: measure steps 1, 2 and every interval-th (see the module docstring)
        self.last_peak: int | None = None
        self.measured = False  # whether the last step was measured (else last_peak is an earlier step's)
        self._first_step: int | None = None  # of this process: a resumed run's first is past 1
        self._cpu_tracker = LiveTensorBytes(track_resizes) if enabled and device.type == "cpu" else None

    def measures(self, step: int) -> bool:
        first = step if self._first_step is None else self._first_step
        return self.enabled and (self.device.type == "cuda" or step < first + 2 or step % self.interval == 0)

    def step(self, state_tensors: Iterable[torch.Tensor] = (), step: int = 1):
        """The scope of training step `step` (1-based): measured or not, by `measures(step)`."""
        if self._first_step is None:
            self._first_step = step
        self.measured = self.measures(step)
        return _StepScope(self, state_tensors)


class _StepScope:
    def __init__(self, meter: PeakMemory, state_tensors: Iterable[torch.Tensor]) -> None:
        self.meter = meter
        self.state_tensors = state_tensors

    def __enter__(self):
        m = self.meter
        if not m.measured:
            return self
        if m.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(m.device)
        elif m._cpu_tracker is not None:
            m._cpu_tracker.track(self.state_tensors)
            m._cpu_tracker.reset_peak()
            m._cpu_tracker.__enter__()
        return self

    def __exit__(self, *exc):
        m = self.meter
        if not m.measured:
            return False
        if m.device.type == "cuda":
            m.last_peak = int(torch.cuda.max_memory_allocated(m.device))
        elif m._cpu_tracker is not None:
            m._cpu_tracker.__exit__(*exc)
            m.last_peak = int(m._cpu_tracker.peak)
        return False
