"""The memory model phase by phase: every window of a training step (each forward, the loss,
each backward, the gradient reduction, the optimizer step) against the model's point for it, as
bytes above the step's starting state (tests/memory_phases.py); printed only, for the configs not
yet within 10% (NOT_YET).

The peak test (test_memory.py) holds the largest point to 10%; here every point is held to the
same 10% of what the window adds, so a term that never sets the peak is checked too. The
sequence is 48 tokens per row, so no two of the model's terms are equal by accident (at 32 the
logits and the head's weight gradient have the same size, and either could stand for the other).
`python tests/test_memory_phases.py` prints the table in docs/memory.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import small_cfg, write_offline_corpus  # noqa: E402
from memory_phases import compare, measure_windows  # noqa: E402

from meshlm.testing import run_ranks  # noqa: E402

TOLERANCE = 0.10
SEQ = ("train.seq_len=48",)
GRID: list[tuple[int, str, tuple[str, ...]]] = [  # (ranks, the collectives' backend, overrides)
    (1, "shm", ()),
    (1, "shm", ("train.recompute=full",)),
    (1, "shm", ("train.recompute=selective",)),
    (1, "shm", ("train.micro_batch_size=8",)),
    (1, "shm", ("model.tie_embeddings=true",)),
    (1, "shm", ("train.dtype=bfloat16",)),
    (1, "shm", ("train.dtype=bfloat16", "train.recompute=full")),
    # few tokens, so the gradients outweigh the activations: the first backward's embedding
    # gradient becomes its .grad; a tied table's two gradients are summed out of place
    (1, "shm", ("train.seq_len=16",)),
    (1, "shm", ("train.seq_len=16", "model.tie_embeddings=true", "model.vocab_size=4099", "train.global_batch_size=4")),
    # ... and a wide MLP: w2's weight gradient, before it is accumulated, outweighs the gate and up
    # gradients of a block's backward (-12% in every backward before)
    (1, "shm", ("train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4", "model.n_layers=1",
                "model.vocab_size=272", "model.ffn_dim=1024")),
    (2, "shm", ("parallel.zero=0",)),
    (2, "shm", ("parallel.zero=1",)),
    (2, "shm", ("parallel.zero=2",)),
    (2, "shm", ("parallel.zero=3",)),
    (2, "shm", ("parallel.zero=1", "model.tie_embeddings=true")),
    # a vocabulary larger than the blocks: the tied table's gradients sum out of place (3 tables)
    (2, "shm", ("parallel.zero=0", "model.tie_embeddings=true", "model.vocab_size=4099", "train.global_batch_size=4")),
    # ... untied under ZeRO-3: the root unit (embedding, head) completes with a root-sized fp32 staging
    (2, "shm", ("parallel.zero=3", "model.vocab_size=4099", "train.global_batch_size=4")),
    # ... in bf16 weights: the head's gradient waits (2 bytes), the root's fp32 shard not yet made (4)
    (2, "shm", ("parallel.zero=3", "model.vocab_size=4099", "train.global_batch_size=4", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.zero=3", "model.tie_embeddings=true")),
    # ... tied under ZeRO-2: the table has a bucket of its own, three tables at its backward
    (2, "shm", ("parallel.zero=2", "model.tie_embeddings=true", "model.vocab_size=4099", "train.global_batch_size=4")),
    (2, "shm", ("parallel.zero=1", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.zero=2", "train.dtype=bfloat16")),
    # ZeRO-2's step with a wide MLP: AdamW keeps the previous segment's denominator beside the next
    # one's two temporaries, three ffn weights' slices in a row (-26% in the optimizer step before)
    (2, "shm", ("parallel.zero=2", "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4",
                "model.ffn_dim=512")),
    (2, "shm", ("parallel.zero=3", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.tp=2",)),
    (2, "shm", ("parallel.tp=2", "parallel.sp=true")),
    (2, "shm", ("parallel.cp=2",)),
    (2, "gloo", ("parallel.zero=1",)),
    (2, "gloo", ("parallel.zero=2",)),
    (2, "gloo", ("parallel.zero=3",)),
    (4, "shm", ("parallel.zero=3",)),
    # pipelines: every schedule, the deferred weight-gradient flush, P2P buffers, with dp, tp + sp, bf16
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=1f1b", "model.n_layers=4")),  # two blocks a stage
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=gpipe", "train.recompute=full")),
    # two rebuilt blocks a stage: the store keeps a finished block's linear inputs, not the block
    (2, "shm", ("parallel.pp=2", "model.n_layers=4", "train.recompute=full", "train.micro_batch_size=4")),
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=4")),
    (2, "shm", ("parallel.pp=2", "parallel.zero=1", "train.dtype=bfloat16")),
    # ... four rows a micro-batch: the final norm's backward (five fp32 temporaries) beside every
    # block's saved tensors and the deferring head's input and logits' gradient (-10.3% before)
    (2, "shm", ("parallel.pp=2", "parallel.zero=1", "train.dtype=bfloat16", "train.micro_batch_size=4",
                "train.global_batch_size=16")),
    # ... wider: the last bucket's fp32 copy is made in the flush, after the next sends and receives
    # are posted, beside the weight gradient whose hook launches it (-12% in the flush before)
    (2, "shm", ("parallel.pp=2", "parallel.zero=1", "train.dtype=bfloat16", "model.dim=128", "model.ffn_dim=128",
                "model.vocab_size=272")),
    (2, "shm", ("parallel.pp=2", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.pp=2", "parallel.pp_defer_wgrad=false", "model.tie_embeddings=true")),
    (4, "shm", ("parallel.dp=2", "parallel.pp=2", "parallel.zero=1")),
    (4, "shm", ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2")),
    (4, "shm", ("parallel.pp=4", "model.n_layers=4")),
    # from a 220-config random sweep (session 18's review):
    # SP under full recompute: a recompute that stops early left its region's input, and the
    # rebuilt graph behind it, alive to the next forward (+577% in the loss window before)
    (2, "shm", ("parallel.tp=2", "parallel.sp=true", "train.recompute=full")),
    # ZeRO-1 in bf16: the last bucket's fp32 copy is made in the syncing backward (-45% there)
    (2, "shm", ("parallel.cp=2", "parallel.zero=1", "train.dtype=bfloat16", "model.tie_embeddings=true",
                "model.n_layers=6", "model.dim=128", "model.ffn_dim=336", "model.vocab_size=2354",
                "train.seq_len=16", "train.global_batch_size=4")),
    # ZeRO-2: a bucket closes past the cap (a block and a half here); a tied head's gradient waits (-15%)
    (2, "shm", ("parallel.zero=2", "model.dim=128", "model.n_heads=8", "model.n_kv_heads=1", "model.ffn_dim=400",
                "model.n_layers=6", "model.vocab_size=272", "model.tie_embeddings=true", "train.seq_len=16",
                "train.micro_batch_size=1", "train.global_batch_size=4", "train.recompute=full")),
    # a deferring head makes no weight gradient in its backward (+16% in the last stage's last backward)
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=gpipe", "model.dim=128", "model.n_heads=8",
                "model.n_kv_heads=4", "model.ffn_dim=352", "model.vocab_size=1612", "train.seq_len=16",
                "train.micro_batch_size=5", "train.global_batch_size=40")),
    # ZeRO-2 at one data-parallel rank: its gradient shard (the whole gradient) is made when the
    # second bucket launches, inside the top block's MLP or before the top block (-14% before)
    (1, "shm", ("parallel.zero=2",)),
    (2, "shm", ("parallel.pp=2", "parallel.zero=2")),
    # ZeRO-3 under a pipeline: a unit's shard is made unit by unit as its reduction is waited for;
    # the last stage's root (head) waits for the blocks; the root's output gradient prefetches the
    # top block (+27% and +21% in the first backwards, at dp 1 and 2, before)
    (2, "shm", ("parallel.pp=2", "parallel.zero=3")),
    (4, "shm", ("parallel.dp=2", "parallel.pp=2", "parallel.zero=3")),
    # ... and its optimizer step: AdamW's previous denominator lives beside the next segment's
    # two temporaries (the head and the embedding, the three ffn weights, in a row: -13% before)
    (1, "shm", ("parallel.zero=3",)),
    (4, "shm", ("parallel.pp=4", "model.n_layers=4", "parallel.zero=3")),
    # ... one block a stage, few tokens: a block completing prefetches no unit where its stage has
    # no other block (+19% in the first stage's backwards before), and the last stage's blocks run
    # before its final norm gathers the root (+27% in its first forward before)
    (2, "shm", ("parallel.pp=2", "parallel.zero=3", "train.seq_len=16")),
    # ... tied: the first stage's embedding is not its head (the last stage holds its own copy), so
    # its table is cut off after forward as an untied one's (+14% in the first backward before)
    (2, "shm", ("parallel.pp=2", "parallel.zero=3", "train.seq_len=16", "model.tie_embeddings=true")),
    # ... in bf16 with a large root at one data-parallel rank: the root gathered from its whole bf16
    # copy, and its shard made beside its fp32 staging at the backward's end (-32%, -22% before)
    (2, "shm", ("parallel.pp=2", "parallel.zero=3", "train.dtype=bfloat16", "model.vocab_size=3000",
                "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4")),
    # ... interleaved: a chunk's backward gathers its own blocks only (the engine prefetched the
    # other chunk's: -15% in the first stage's backwards before)
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=4",
                "parallel.zero=3")),
    # ... with tensor parallelism, few tokens: the vocabulary-parallel embedding's table is cut off
    # after forward, as nn.Embedding's (the engine kept it through the loss: -16% there before)
    (2, "shm", ("parallel.tp=2", "parallel.zero=3", "train.seq_len=16")),
    # the vocabulary-parallel head: its whole weight where the rank has no padding rows (slicing it
    # copied the head's gradient in backward: -14% in each backward); a padded rank's slice does
    (2, "shm", ("parallel.tp=2", "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4",
                "model.vocab_size=2000")),
    (2, "shm", ("parallel.tp=2", "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=4",
                "model.vocab_size=2001")),
    # autocast with SP: the column linears (q, k, v, gate, up, the head) save their fp32 weight and
    # their region's fp32 input shard, no bf16 copies (+20% to +65% in the loss window before, and
    # in a pipeline +12% to +22%, growing with the micro-batches in flight); their backward casts
    # the head's gradient to fp32 beside the bf16 one; the gathered input is fp32
    (2, "shm", ("parallel.tp=2", "parallel.sp=true", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.tp=2", "parallel.sp=true", "train.dtype=bfloat16", "train.recompute=full",
                "train.seq_len=16")),
    (4, "shm", ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "train.dtype=bfloat16")),
    (4, "shm", ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "train.dtype=bfloat16", "train.recompute=full")),
    # autocast and full recompute in a pipeline: the forward of a micro-batch whose backward defers
    # casts its weights itself, uncached (+11% in the last stage's last forward; interleaved, +57%)
    (2, "shm", ("parallel.pp=2", "train.dtype=bfloat16", "train.recompute=full")),
    (4, "shm", ("parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=8",
                "train.dtype=bfloat16", "train.recompute=full", "train.seq_len=16")),
    # ... at one data-parallel rank, few tokens and a wide MLP: a chunk's first backward makes its
    # first block's MLP .grads (each cast from bf16) while the block's attention is rebuilt (-18%
    # and -15% in the first backwards before)
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=8",
                "train.dtype=bfloat16", "train.recompute=full", "train.seq_len=16", "train.micro_batch_size=1",
                "train.global_batch_size=4", "model.dim=128", "model.ffn_dim=352")),
]
# Not yet within 10% (docs/memory.md says where): printed by the table, not asserted.
NOT_YET: list[tuple[int, str, tuple[str, ...]]] = []


def measured_vs_predicted(corpus: Path, run_dir: Path, grid=GRID) -> list[tuple]:
    """(ranks, backend, overrides, pp rank, window, measured, predicted) for every window."""
    import os

    rows = []
    for (world, backend), configs in _groups(grid).items():
        extras = [(*SEQ, *extra) for extra in configs]
        saved = os.environ.get("MESHLM_SHM_DISABLE")
        os.environ["MESHLM_SHM_DISABLE"] = "1" if backend == "gloo" else "0"  # gloo: meshlm's rings
        try:
            if world == 1:
                per_rank = [measure_windows(1, extras, corpus, run_dir)]
            else:
                per_rank = run_ranks(measure_windows, world, world, extras, corpus, run_dir, timeout=300)
        finally:
            if saved is None:
                os.environ.pop("MESHLM_SHM_DISABLE")
            else:
                os.environ["MESHLM_SHM_DISABLE"] = saved
        for i, extra in enumerate(configs):
            cfg = small_cfg(corpus, run_dir, world, *SEQ, *extra)
            for row in compare(cfg, backend, [rank[i] for rank in per_rank]):
                rows.append((world, backend, extra, *row))
    return rows


def _groups(grid) -> dict[tuple[int, str], list[tuple[str, ...]]]:
    groups: dict[tuple[int, str], list[tuple[str, ...]]] = {}
    for world, backend, extra in grid:
        groups.setdefault((world, backend), []).append(extra)
    return groups


def test_every_phase_of_the_step_within_ten_percent_of_measured(tmp_path):
    corpus = write_offline_corpus(tmp_path / "corpus")
    rows = measured_vs_predicted(corpus, tmp_path / "run")
    bad = [row for row in rows if abs(row[-1] / row[-2] - 1) > TOLERANCE]
    assert not bad, bad


# --------------------------------------------------------------------------- stage-boundary tensors


def _boundary_tensors_held(world: int, extra: tuple[str, ...], corpus: Path, run_dir: Path) -> tuple[int, list[int]]:
    """At the start of each compute op of step 2: how many stage-boundary tensors the engine holds
    beside what the op reads (receive buffers posted and not yet read, input gradients made and
    not sent or still held by their send, sent outputs past their backward), each tracked by a
    weak reference from where the engine makes or posts it."""
    import weakref

    import meshlm.parallel.pipeline.engine as engine_module
    from helpers import build_trainer
    from meshlm.parallel.pipeline.schedules import BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD

    trainer = build_trainer(small_cfg(corpus, run_dir, world, *SEQ, *extra))
    engine = trainer.pipeline.engine
    received: dict[tuple, weakref.ref] = {}  # (op, chunk, mb) -> its buffer
    sent: dict[tuple, weakref.ref] = {}
    unsent: list[dict] = []  # the run's to_send
    done: set[tuple] = set()  # (op, chunk, mb) of compute ops that have run
    counts: list[int] = []
    post = engine._post

    def traced_post(batch, spec, inputs, grads, to_send, *rest):
        unsent[:] = [to_send]
        for ins in batch:
            key = (ins.op, ins.chunk, ins.microbatch)
            if ins.op in (SEND_ACT, SEND_GRAD):
                sent[key] = weakref.ref(to_send[key])
        post(batch, spec, inputs, grads, to_send, *rest)
        for ins in batch:
            if ins.op in (RECV_ACT, RECV_GRAD):
                store = inputs if ins.op == RECV_ACT else grads
                received[(ins.op, ins.chunk, ins.microbatch)] = weakref.ref(store[(ins.chunk, ins.microbatch)])

    def held_now(ins) -> int:
        reads = (RECV_ACT if ins.op == FORWARD else RECV_GRAD, ins.chunk, ins.microbatch)
        waiting = sum(1 for (op, c, mb), ref in received.items() if ref() is not None and key_pending(op, c, mb)
                      and (op, c, mb) != reads)
        held = sum(1 for (op, c, mb), ref in sent.items() if ref() is not None
                   and (op == SEND_GRAD or (BACKWARD, c, mb) in done))
        return waiting + held + sum(1 for op, *_ in (unsent[0] if unsent else {}) if op == SEND_GRAD)

    def key_pending(op, chunk, mb) -> bool:
        return ((FORWARD if op == RECV_ACT else BACKWARD), chunk, mb) not in done

    batches = engine_module.p2p_batches
    current = []
    wait = engine._wait

    def traced_batches(program):
        for item in batches(program):
            if not isinstance(item, list) and item.op in (FORWARD, BACKWARD):
                current[:] = [item]
                counts.append(held_now(item))
                done.add((item.op, item.chunk, item.microbatch))
            yield item

    def traced_wait(*args):  # the op's input has arrived: what the engine holds as the op runs
        tensor = wait(*args)
        done.discard((current[0].op, current[0].chunk, current[0].microbatch))
        counts[-1] = held_now(current[0])
        done.add((current[0].op, current[0].chunk, current[0].microbatch))
        return tensor

    engine._post = traced_post
    engine._wait = traced_wait
    engine_module.p2p_batches = traced_batches
    try:
        trainer.train_step()
        for seen in (received, sent, done, counts):  # step 2 alone
            seen.clear()
        trainer.train_step()
    finally:
        engine_module.p2p_batches = batches
    return trainer.ctx.coord("pp"), counts


@pytest.mark.parametrize("world,extra", [
    (2, ("parallel.pp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=16")),
    (4, ("parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=8")),
], ids=["1f1b-m8", "interleaved-pp4"])
def test_the_boundary_tensors_held_at_each_op_are_the_models(tmp_path, world, extra):
    """boundary_held_bytes against the engine: receive buffers posted ahead, sent gradients held
    on gloo until a message from their receiver shows they were received (else to reduce_grads),
    sent outputs past their backward (the phase windows see these only where they exceed a tenth
    of a window)."""
    from meshlm.analysis.memory_schedule import boundary_held_bytes
    from meshlm.analysis.memory_terms import boundary_bytes

    corpus = write_offline_corpus(tmp_path / "corpus")
    cfg = small_cfg(corpus, tmp_path / "run", world, *SEQ, *extra)
    for pp_rank, counts in run_ranks(_boundary_tensors_held, world, world, extra, corpus, tmp_path / "run",
                                     timeout=300):
        predicted = [during // boundary_bytes(cfg) for during, _ in boundary_held_bytes(cfg, pp_rank, "gloo")]
        assert counts == predicted, pp_rank


if __name__ == "__main__":  # the table in docs/memory.md
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_offline_corpus(Path(tmp) / "corpus")
        print("| ranks | backend | overrides | role | window | measured | predicted | error |")
        print("|---|---|---|---|---|---:|---:|---:|")
        rows = measured_vs_predicted(corpus, Path(tmp) / "run", GRID + NOT_YET)
        for world, backend, extra, pp_rank, window, measured, predicted in rows:
            print(f"| {world} | {backend} | {' '.join(extra) or '(defaults)'} | pp{pp_rank} | {window} | {measured:,} | "
                  f"{predicted:,} | {predicted / measured - 1:+.1%} |")
