"""FSDP units: which modules become one (wrapping policies, the bottom-up choice) and the unit
itself (its fp32 shard, gradient shard and unsharded buffer).

A unit is the granularity of ZeRO-3's all-gather and reduce-scatter: bigger units mean fewer,
larger collectives (better bandwidth) but more parameters unsharded at once (more memory).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from meshlm.parallel.flat_buffer import Slot, round_up
from meshlm.parallel.mixed_precision import MixedPrecision
from meshlm.parallel.sharded_init import repoint

# policy(name, module, numel of its parameters not yet in a unit below it) -> make it a unit?
WrapPolicy = Callable[[str, nn.Module, int], bool]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called, so they cannot have forward hooks


def by_class(*classes: type) -> WrapPolicy:
    """One unit per module of these classes (e.g. the transformer block)."""
    return lambda name, module, numel: isinstance(module, classes)


def by_size(min_numel: int) -> WrapPolicy:
    """One unit per module holding at least `min_numel` parameters outside the units below it
    (decided bottom-up, like torch's size_based_auto_wrap_policy)."""
    return lambda name, module, numel: numel >= min_numel


def choose_units(module: nn.Module, policy: WrapPolicy | None) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """(unit name, its named parameters) in forward (pre-)order; the root ('<root>') first with
    whatever no unit took. Children are decided before parents, so a parent only gets the rest.
    A parameter shared with a module outside a candidate's subtree (a tied embedding and head) is
    left to an ancestor holding all its users, at worst the root: a unit frees its parameters
    after its own forward, and the other user would read freed storage."""
    taken: set[int] = set()
    chosen: dict[str, list] = {}
    users: dict[int, list[str]] = {}
    for sub_name, sub in module.named_modules():
        for p in sub.parameters(recurse=False):
            users.setdefault(id(p), []).append(sub_name)

    def inside(p: nn.Parameter, name: str) -> bool:
        return all(user == name or user.startswith(name + ".") for user in users[id(p)])

    def visit(name: str, sub: nn.Module) -> None:
        for child_name, child in sub.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if sub is module or policy is None or isinstance(sub, _CONTAINERS):
            return
        params = [(f"{name}.{pn}", p) for pn, p in sub.named_parameters() if id(p) not in taken and inside(p, name)]
        if params and policy(name, sub, sum(p.numel() for _, p in params)):
            taken.update(id(p) for _, p in params)
            chosen[name] = params

    visit("", module)
    order = [name for name, _ in module.named_modules() if name in chosen]
    root = [(pn, p) for pn, p in module.named_parameters() if id(p) not in taken]
    return [("<root>", root)] + [(name, chosen[name]) for name in order]


# (slot, lo, hi) -> elements [lo, hi) of the slot's parameter, flat: where a unit's shard comes from.
ValueSource = Callable[[Slot, int, int], torch.Tensor]


def values_from_parameters(slot: Slot, lo: int, hi: int) -> torch.Tensor:
    return slot.param.detach().reshape(-1)[lo:hi]


class Unit:
    """One flat-parameter unit: this rank's fp32 shard, its gradient shard, the unsharded buffer.

    Only the shard is ever built here: `values(slot, lo, hi)` gives elements [lo, hi) of a
    slot's parameter (read from the parameter, or drawn by sharded_init for a meta-device model),
    and the unsharded buffer gets storage only at the first gather. Until then each parameter is
    a zero-stride placeholder of the right shape, so construction never holds a whole unit.
    """

    def __init__(self, index: int, name: str, slots: list[Slot], n: int, rank: int, precision: MixedPrecision,
                 device: torch.device, values: "ValueSource") -> None:
        self.index, self.name, self.slots, self.precision = index, name, slots, precision
        numel = slots[-1].end
        self.padded = round_up(numel, n)
        self.lo, self.hi = rank * self.padded // n, (rank + 1) * self.padded // n
        self.shard = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=device)  # fp32 master slice
        with torch.no_grad():
            for s in slots:
                a, z = max(self.lo, s.start), min(self.hi, s.end)
                if a < z:
                    self.shard[a - self.lo: z - self.lo] = values(s, a - s.start, z - s.start)
            placeholder = torch.zeros(1, dtype=precision.param_dtype, device=device)
            for s in slots:
                repoint(s.param, placeholder.expand(s.shape))
        self.grad_shard: torch.Tensor | None = None  # allocated by the first reduce-scatter of a step
        self.full = torch.empty(0, dtype=precision.param_dtype, device=device)  # storage: see `bind`
        self.itemsize = self.full.element_size()
        self.bound = False
        self.handle = None  # the all-gather in flight
        self.gathered = False
        self.trimmed = False  # gathered, but the storage cut to its first `tail` elements
        self.tail = numel  # embedding weights (root only) start here; numel: none

    def bind(self) -> None:
        """Give the unsharded buffer its storage and make the parameters views of it (first
        gather). From then on its storage is resized, never replaced, so the parameters (and
        autograd's saved references to them) stay views of whatever is gathered into it. Made
        outside inference mode even under it: an inference tensor could never be written by a
        later training step's gather."""
        with torch.inference_mode(False):
            self.full = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
            for s in self.slots:
                repoint(s.param, self.full[s.start: s.end].view(s.shape))
        self.bound = True

    def trim(self) -> None:
        """Drop the buffer's tail (embedding weights no backward reads): shrink the storage."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self.full.untyped_storage().resize_(self.tail * self.itemsize)
        self.trimmed = True

    def grads(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros_like(self.shard)
        return self.grad_shard

    def free(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.bound:
            self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.trimmed = False
