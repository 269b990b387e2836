"""The step-time model's communication volume is what the engines send: every collective and send
of one micro-batch, by op, axis and size, counted by each rank's flight recorder in real runs
(tensor + sequence parallel, context parallel, pipelines plain and interleaved; fp32, bf16
weights, and bf16 autocast over fp32 weights, where norms and the residual stream stay fp32)
against `analysis/messages.py`, rank by rank."""

from collections import Counter

import pytest
import torch

from helpers import build_trainer, small_cfg
from meshlm.analysis.hardware import gpu
from meshlm.analysis.messages import stage_messages
from meshlm.analysis.steptime import Layout, Workload
from meshlm.testing import run_ranks

MICRO_BATCH = 2


def _sent(trainer) -> Counter:
    """(op, axis, bytes) -> how many this rank issued in its step; receives are the peers' sends."""
    return Counter((r["op"], r["axis"], r["nbytes"]) for r in trainer.comm.recorder.dump() if r["op"] != "recv")


def _per_micro_batch(corpus, run_dir, world, extra):
    """What one more micro-batch adds to a step (steps of 2 and 4 micro-batches: what happens
    once a step, the loss and norm scalars, cancels), and this rank's pipeline stage."""
    torch.set_num_threads(1)
    counts = []
    for micro_batches in (2, 4):
        cfg = small_cfg(corpus, run_dir, world, f"train.micro_batch_size={MICRO_BATCH}",
                        f"train.global_batch_size={MICRO_BATCH * micro_batches}", *extra, steps=1)
        trainer = build_trainer(cfg)
        trainer.train_step()
        counts.append(_sent(trainer))
    per = {k: (counts[1][k] - counts[0][k]) / 2 for k in counts[0] | counts[1] if counts[1][k] != counts[0][k]}
    return trainer.ctx.coord("pp"), per, cfg


def _layout(cfg) -> Layout:
    par = cfg.parallel
    return Layout(par.dp, par.tp, par.pp, par.cp, par.zero, cfg.train.recompute, cfg.train.micro_batch_size,
                  par.pp_schedule if par.pp > 1 else "none", par.pp_virtual)


CASES = {
    # autocast: fp32 norms, embedding, boundary; bf16 GEMM outputs; the recompute's early stop
    "tp2-sp-pp2-autocast-full": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=0",
                                     "train.dtype=bfloat16", "train.recompute=full"]),
    "tp2-sp-pp2-bf16-weights": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=1",
                                    "train.dtype=bfloat16"]),
    "cp2-pp2-autocast-full": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.zero=0", "train.dtype=bfloat16",
                                  "train.recompute=full"]),
    # one stage is both first and last; kv heads shared by the tp ranks' ring; tied embeddings
    "tp2-sp-cp2-fp32-tied": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "model.tie_embeddings=true"]),
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
                            "model.n_layers=4"]),
}


@pytest.mark.parametrize("case", CASES)
def test_every_message_of_a_micro_batch_is_the_models(corpus, tmp_path, case):
    world, extra = CASES[case]
    for stage, measured, cfg in run_ranks(_per_micro_batch, world, corpus, tmp_path, world, extra, timeout=240):
        lay = _layout(cfg)
        work = Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.dtype, gpu("h100-80gb"),
                        lay.world, lay.world)
        model = {(msg.op, msg.axis, msg.nbytes): msg.forward + msg.backward
                 for msg in stage_messages(work, lay, stage)}
        assert measured == model, (case, stage)
