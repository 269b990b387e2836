"""Pipeline parallelism: the model cut into stages on a chain of ranks, micro-batches streamed
through them by a schedule that is plain data.

- `schedules`: pure functions from (kind, pp, micro-batches, virtual) to per-rank instruction lists.
- `stage`: split a Llama into this rank's stage module(s), single-process parameter names kept.
- `p2p`: activation/gradient messages with shapes and dtypes agreed up front.
- `engine`: the one small executor of any instruction list; records busy and idle time.
- `runner`: the seam the trainer calls (forward_backward, evaluate, full weights, metrics).
The simulator that draws the same lists is `meshlm.analysis.pipeline_sim`.
"""

from meshlm.parallel.pipeline.schedules import (SCHEDULES, Instruction, PipelineShape, ScheduleError,
                                                build_schedule, check_schedule, compute_order)
from meshlm.parallel.pipeline.stage import PipelineStageModel, split_for_rank, split_layers

__all__ = ["SCHEDULES", "Instruction", "PipelineShape", "PipelineStageModel", "ScheduleError", "build_schedule",
           "check_schedule", "compute_order", "split_for_rank", "split_layers"]
