"""Per-rank peak memory of a training step, measured: CUDA's allocator statistics on GPU, and on
CPU a count of live tensor bytes (peak RSS is useless here: the allocator keeps freed pages).

On CPU every aten op passes through a TorchDispatchMode that notes each new storage and a weak
reference that subtracts its bytes when the storage dies. That costs Python time per op, so it
can be switched off (`train.track_memory=false`); on CUDA it is never used.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created inside the mode, plus any registered with
    `track`; `peak` is the high-water mark since the last `reset_peak`."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes = WeakIdKeyDictionary()
        self._refs: set[weakref.ref] = set()
        self.live = 0
        self.peak = 0

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (parameters, gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._note(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _note(self, t: torch.Tensor) -> None:
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
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def freed(ref: weakref.ref, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._refs.discard(ref)

        self._refs.add(weakref.ref(storage, freed))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t)
        return out


class PeakMemory:
    """Measures the peak bytes of each training step on this rank, on CPU or CUDA alike.

    Usage: `with meter.step(state_tensors): ...` then read `meter.last_peak` (None if disabled).
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self.last_peak: int | None = None
        self._cpu_tracker = LiveTensorBytes() if enabled and device.type == "cpu" else None

    def step(self, state_tensors: Iterable[torch.Tensor] = ()):
        return _StepScope(self, state_tensors)


class _StepScope:
    def __init__(self, meter: PeakMemory, state_tensors: Iterable[torch.Tensor]) -> None:
        self.meter = meter
        self.state_tensors = state_tensors

    def __enter__(self):
        m = self.meter
        if not m.enabled:
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
        if not m.enabled:
            return False
        if m.device.type == "cuda":
            m.last_peak = int(torch.cuda.max_memory_allocated(m.device))
        elif m._cpu_tracker is not None:
            m._cpu_tracker.__exit__(*exc)
            m.last_peak = int(m._cpu_tracker.peak)
        return False
