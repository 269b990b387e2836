"""Durable writes: a file's data on disk before its name says it exists, and renames on disk.

Reduces: what a power or node loss can leave behind (a checkpoint or a data cache that counts as
complete with a file of zeros). Costs: an fsync per file and per directory written, milliseconds
on local disks. Shared by checkpoints (train/checkpoint/store.py) and the data cache
(data/shards.py), which both mark completeness by a rename or a marker written last.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable (its entries are data of the directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """os.replace(tmp, path) with tmp's data on disk first and the rename on disk after."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)
