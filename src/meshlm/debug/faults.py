"""Fault injection (`debug.fault`): each failure meshlm diagnoses, made on purpose, on one rank
(`debug.fault_rank`) at one step (`debug.fault_step`), so the diagnosis is tested end to end and a
user can see what each failure looks like before meeting it for real.

- kill:   SIGKILL after the step (first attempt only: a torchrun restart runs clean).
- hang:   stop before the step's first collective and never come back (the others wait in it).
- desync: the step's first all-reduce reads its bytes as an integer dtype of the same width: the
          shapes and sizes match, so no backend notices, and the step-end check catches it.
- raise:  raise an exception at the start of the step.
- nan:    the step's forward returns NaN (so its loss and gradients are not finite).
- slow:   sleep `debug.fault_slow_s` at the start of every step from `fault_step` on (a straggler).
- oom:    allocate far past the device's memory in the step's forward.

Costs: nothing when `debug.fault=none` (no hook is installed); one comparison per step otherwise.
"""

from __future__ import annotations

import os
import signal
import time

import torch


class FaultInjector:
    def __init__(self, debug_cfg, rank: int, comm, log) -> None:
        self.fault = debug_cfg.fault
        self.step = debug_cfg.fault_step
        self.slow_s = debug_cfg.fault_slow_s
        self.mine = debug_cfg.fault != "none" and rank == debug_cfg.fault_rank
        self.comm, self.log, self.rank = comm, log, rank
        self.current_step = 0  # the step being run, 1-based

    def install(self, model: torch.nn.Module) -> None:
        """Faults that live inside the forward pass hook the model (only on the faulty rank)."""
        if self.mine and self.fault in ("nan", "oom"):
            model.register_forward_hook(self._in_forward)

    def before_step(self, step: int) -> None:
        self.current_step = step
        if not self.mine:
            return
        if self.fault == "slow" and step >= self.step:
            time.sleep(self.slow_s)
        if step != self.step:
            return
        self.log.info("debug.fault=%s on rank %d at step %d", self.fault, self.rank, step)
        if self.fault == "hang":
            while True:  # never returns: the watchdog dumps and ends the process
                time.sleep(1.0)
        if self.fault == "raise":
            raise RuntimeError(f"debug.fault=raise: injected on rank {self.rank} at step {step}")
        if self.fault == "desync":  # this step's first all-reduce, with another shape and dtype
            self.comm.desync_next = True

    def after_step(self, step: int) -> None:
        if not (self.mine and self.fault == "kill" and step == self.step):
            return
        from meshlm.train.checkpoint.resume import is_restart

        if not is_restart():
            self.log.info("debug.fault=kill: SIGKILL to rank %d after step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _in_forward(self, module, inputs, output):
        if self.current_step != self.step or not module.training:
            return None
        if self.fault == "nan":
            return output * float("nan")
        device = output.device
        too_much = 4 * torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 2**60
        torch.empty(too_much, dtype=torch.uint8, device=device)  # raises: out of memory
        return None
