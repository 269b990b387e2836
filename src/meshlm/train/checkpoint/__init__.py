"""Sharded checkpoints: each rank saves what it owns; any layout loads any checkpoint.

Reduces: the work lost to a crash, a preemption or a change of cluster shape, to the steps
since the last checkpoint (and to nothing on a clean stop).
Costs: per save, the model state written once (16 bytes/parameter: fp32 weights and AdamW's
two moments, no replica written twice), a hash of every byte, three barriers; training waits.

- `pieces`: what a rank owns, as rectangles of the single-process tensors (the reshard key);
- `store`: files, manifest, atomic rename, verification, discovery, rotation, the reader;
- `state`: a Trainer's state to and from those files;
- `resume`: which checkpoint a run continues from.
"""

from meshlm.train.checkpoint.state import SaveReport, load_checkpoint, save_checkpoint
from meshlm.train.checkpoint.store import CheckpointError, CheckpointReader

__all__ = ["CheckpointError", "CheckpointReader", "SaveReport", "load_checkpoint", "save_checkpoint"]
