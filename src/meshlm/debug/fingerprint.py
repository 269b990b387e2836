"""A desync caught at the step it happens, even when the backend does not notice it.

Reduces: a collective called with another shape or dtype on one rank (gloo and NCCL move the
bytes when the sizes match, and training goes on with garbage) to an error at the end of that
step naming the odd rank.
Costs: a CRC of a short string per collective (about half a microsecond) and one number more in
the small all-gather every step already makes.

Ranks that differ only in their tp, cp or dp coordinate do the same work: the same collectives,
in the same order, with the same shapes (tensor-parallel shards are padded to equal sizes;
ZeRO's flat shards too). So the fingerprint of each rank's collectives (op, size, dtype) in one
training step must be equal across the ranks of one pipeline stage. Pipeline stages differ, but
their collectives on the pipeline axis (the loss's sum, ...) do not: a second fingerprint of
those alone is compared across the stages of each pipeline. Evaluation is not compared.
"""

from __future__ import annotations

from collections import Counter

from meshlm.errors import RunError


class DesyncError(RunError):
    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def odd_ranks(fingerprints: list[float], stages: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[int]] | None:
    """The first stage whose ranks disagree, and the ranks outside its majority (all of them on a tie)."""
    for stage in stages:
        counts = Counter(fingerprints[r] for r in stage)
        if len(counts) == 1:
            continue
        (top, n), *rest = counts.most_common()
        if rest and rest[0][1] == n:
            return stage, list(stage)
        return stage, [r for r in stage if fingerprints[r] != top]
    return None


def check(fingerprints: list[float], stages: list[tuple[int, ...]], step: int) -> None:
    found = odd_ranks(fingerprints, stages)
    if found is None:
        return
    stage, odd = found
    raise DesyncError(f"desync at step {step}: rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} called "
                      f"different collectives (op, shape or dtype) than the other ranks of {list(stage)}", odd)
