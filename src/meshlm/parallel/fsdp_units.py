"""Which modules become FSDP units: wrapping policies and the bottom-up choice of units.

A unit is the granularity of ZeRO-3's all-gather and reduce-scatter: bigger units mean fewer,
larger collectives (better bandwidth) but more parameters unsharded at once (more memory).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

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
    whatever no unit took. Children are decided before parents, so a parent only gets the rest."""
    taken: set[int] = set()
    chosen: dict[str, list] = {}

    def visit(name: str, sub: nn.Module) -> None:
        for child_name, child in sub.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if sub is module or policy is None or isinstance(sub, _CONTAINERS):
            return
        params = [(f"{name}.{pn}", p) for pn, p in sub.named_parameters() if id(p) not in taken]
        if params and policy(name, sub, sum(p.numel() for _, p in params)):
            taken.update(id(p) for _, p in params)
            chosen[name] = params

    visit("", module)
    order = [name for name, _ in module.named_modules() if name in chosen]
    root = [(pn, p) for pn, p in module.named_parameters() if id(p) not in taken]
    return [("<root>", root)] + [(name, chosen[name]) for name in order]
