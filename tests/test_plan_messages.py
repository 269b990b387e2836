"""The step-time model's communication volume is what the engines send: every collective and send
of one micro-batch, by op, axis and size, and the data-parallel bytes of a micro-batch and of a
step, counted by each rank's flight recorder in real runs (tensor + sequence parallel, context
parallel, pipelines plain and interleaved, ZeRO 0-3; fp32, bf16 weights, and bf16 autocast over
fp32 weights, where norms and the residual stream stay fp32) against `analysis/messages.py`,
rank by rank."""

from collections import Counter

import pytest
import torch

from helpers import build_trainer, small_cfg
from meshlm.analysis.hardware import gpu
from meshlm.analysis.messages import data_parallel_bytes, stage_messages
from meshlm.analysis.steptime import Layout, Workload
from meshlm.testing import run_ranks

MICRO_BATCH = 2
SCALARS = 16  # elements: fewer is one of the step's metrics, not the weights' reduction


def _sent(trainer) -> tuple[Counter, Counter]:
    """This rank's step: (op, axis, bytes) -> how many, of every send and every collective but the
    data-parallel ones (receives are the peers' sends), and op -> bytes over dp, whatever the
    buckets, without the metrics' scalars (loss, token count, gradient norm: a few elements)."""
    messages, data_parallel = Counter(), Counter()
    for r in trainer.comm.recorder.dump():
        if "dp" in r["axis"]:
            if r["numel"] >= SCALARS:
                data_parallel[r["op"]] += r["nbytes"]
        elif r["op"] != "recv":
            messages[(r["op"], r["axis"], r["nbytes"])] += 1
    return messages, data_parallel


def _per_micro_batch_and_step(corpus, run_dir, world, dp, extra):
    """What one more micro-batch adds to a step (steps of 2 and 4 micro-batches per pipeline: what
    happens once a step cancels), what is left once a step, and this rank's pipeline stage."""
    torch.set_num_threads(1)
    runs = []
    for micro_batches in (2, 4):
        cfg = small_cfg(corpus, run_dir, world, f"train.micro_batch_size={MICRO_BATCH}",
                        f"train.global_batch_size={MICRO_BATCH * micro_batches * dp}", *extra, steps=1)
        trainer = build_trainer(cfg)
        trainer.train_step()
        runs.append(_sent(trainer))
    (short, short_dp), (long, long_dp) = runs
    per = {k: (long[k] - short[k]) / 2 for k in short | long if long[k] != short[k]}
    dp_per = {k: (long_dp[k] - short_dp[k]) / 2 for k in short_dp | long_dp if long_dp[k] != short_dp[k]}
    dp_step = {k: short_dp[k] - 2 * dp_per.get(k, 0) for k in short_dp if short_dp[k] != 2 * dp_per.get(k, 0)}
    return trainer.ctx.coord("pp"), per, dp_per, dp_step, cfg


def _layout(cfg) -> Layout:
    par = cfg.parallel
    return Layout(par.dp, par.tp, par.pp, par.cp, par.zero, cfg.train.recompute, cfg.train.micro_batch_size,
                  par.pp_schedule if par.pp > 1 else "none", par.pp_virtual)


CASES = {  # world, dp, keys
    # autocast: fp32 norms, embedding, boundary; bf16 GEMM outputs; the recompute's early stop
    "tp2-sp-pp2-autocast-full": (4, 1, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=0",
                                        "train.dtype=bfloat16", "train.recompute=full"]),
    "tp2-sp-pp2-bf16-weights": (4, 1, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=1",
                                       "train.dtype=bfloat16"]),
    "cp2-pp2-autocast-full": (4, 1, ["parallel.cp=2", "parallel.pp=2", "parallel.zero=0", "train.dtype=bfloat16",
                                     "train.recompute=full"]),
    # one stage is both first and last; kv heads shared by the tp ranks' ring; tied embeddings
    "tp2-sp-cp2-fp32-tied": (4, 1, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2",
                                    "model.tie_embeddings=true"]),
    "pp2-interleaved": (2, 1, ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
                               "model.n_layers=4"]),
    # data parallel: what each ZeRO stage reduces and gathers, per micro-batch and per step
    "dp2-zero0-autocast": (2, 2, ["parallel.dp=2", "parallel.zero=0", "train.dtype=bfloat16"]),
    "dp2-zero1-bf16-x-pp2": (4, 2, ["parallel.dp=2", "parallel.zero=1", "train.dtype=bfloat16", "parallel.pp=2"]),
    "dp2-zero2-bf16-x-tp2": (4, 2, ["parallel.dp=2", "parallel.zero=2", "train.dtype=bfloat16", "parallel.tp=2",
                                    "parallel.sp=true"]),
    # the root unit (tied embedding and head, final norm) stays gathered from forward to backward
    "dp2-zero3-bf16-tied": (2, 2, ["parallel.dp=2", "parallel.zero=3", "train.dtype=bfloat16",
                                   "model.tie_embeddings=true"]),
    "dp-cp-zero3-fp32": (4, 2, ["parallel.dp=2", "parallel.cp=2", "parallel.zero=3"]),
    # every stage of a pipeline gathers its weights once per micro-batch, the first its embedding too
    "dp2-zero3-bf16-x-pp2-gpipe": (4, 2, ["parallel.dp=2", "parallel.zero=3", "train.dtype=bfloat16", "parallel.pp=2",
                                          "parallel.pp_schedule=gpipe"]),
}


@pytest.mark.parametrize("case", CASES)
def test_every_message_of_a_micro_batch_is_the_models(corpus, tmp_path, case):
    world, dp, extra = CASES[case]
    results = run_ranks(_per_micro_batch_and_step, world, corpus, tmp_path, world, dp, extra, timeout=240)
    for stage, measured, dp_per, dp_step, cfg in results:
        lay = _layout(cfg)
        work = Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.dtype, gpu("h100-80gb"),
                        lay.world, lay.world)
        model = {(msg.op, msg.axis, msg.nbytes): msg.forward + msg.backward
                 for msg in stage_messages(work, lay, stage)}
        assert measured == model, (case, stage)
        sizes = data_parallel_bytes(work, lay, stage)
        per_micro_batch = Counter(sizes["forward"]) + Counter(sizes["backward"])
        assert dp_per == pytest.approx(dict(per_micro_batch), rel=1e-12), (case, stage)
        assert dp_step == pytest.approx(sizes["step"], rel=1e-12), (case, stage)
