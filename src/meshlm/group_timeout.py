"""A process group's own timeout, for what waits beside the group (the shared-memory barrier, the
pipeline's second world group, the mesh's axis groups): init_process_group's (`backend_timeout`
under `meshlm train`), so they give up when the group would, not at gloo's 30-minute default."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_timeout(group=None):
    """torch keeps the timeout in the backend's options only; gloo's default where those cannot be read."""
    group = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return dist.default_pg_timeout
