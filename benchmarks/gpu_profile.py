"""Where one GPU step of `meshlm bench gpu` goes: per phase, the host's time to issue it and the
time until the device has finished it, then the kernels that take the device's time.

    PYTHONPATH=src python3 benchmarks/gpu_profile.py 125m 1024 8 compile [CHUNK_MIB|0 [KEY=VALUE...]]

Reduces: guessing why a step is slower than the reference (host-bound launches, or one phase's
kernels). Costs: a minute of the GPU per shape (the compiled shape compiles first).
A phase whose issue time is close to its finished time is host-bound: the device waited on Python.
CHUNK_MIB (0: the defaults) overrides the loss's chunk sizes (model/loss.py); KEY=VALUE
are config overrides (a tiny shape on a CPU makes every step host-bound, as a small one is on a GPU).
"""

from __future__ import annotations

import sys
import time

import torch

from meshlm.bench.gpu import MeshlmEngine, TransformersEngine, _autocast
from meshlm.bench.timing import random_batch
from meshlm.config import load_config, resolve
from meshlm.mesh import ParallelContext


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def meshlm_phases(e: MeshlmEngine, batch):
    inputs, targets, tokens = batch
    state = {}

    def forward():
        with _autocast(e.device):
            state["logits"] = e.dp.module(inputs)

    def loss():
        state["loss"] = e.loss_sum(state.pop("logits"), targets)

    def backward():
        (state.pop("loss") / tokens).backward()

    return [("forward", forward), ("loss", loss), ("backward", backward),
            ("finish_backward", e.dp.finish_backward),
            ("clip_and_step", lambda: e.dp.clip_and_step(e.train.lr, e.train.grad_clip)),
            ("zero_grad", e.dp.zero_grad)]


def reference_phases(r: TransformersEngine, batch):
    inputs, targets, tokens = batch
    targets = targets.contiguous()
    state = {}

    def forward_loss():
        with _autocast(r.device):
            state["loss"] = r.forward(input_ids=inputs, labels=targets, shift_labels=targets,
                                      num_items_in_batch=tokens).loss

    return [("forward+loss", forward_loss), ("backward", lambda: state.pop("loss").backward()),
            ("clip", lambda: torch.nn.utils.clip_grad_norm_(r.model.parameters(), r.clip)),
            ("step", r.optimizer.step), ("zero_grad", lambda: r.optimizer.zero_grad(set_to_none=True))]


def breakdown(name, phases_of, batch, repeats=3):
    rows = {}
    for _ in range(repeats):
        for phase, run in phases_of(batch):
            sync()
            t0 = time.perf_counter()
            run()
            issued = time.perf_counter() - t0
            sync()
            done = time.perf_counter() - t0
            rows.setdefault(phase, []).append((issued, done))
    print(f"--- {name}: phase, host issue ms, finished ms (median of {repeats})")
    total_issue = total_done = 0.0
    for phase, values in rows.items():
        issued = sorted(v[0] for v in values)[len(values) // 2] * 1e3
        done = sorted(v[1] for v in values)[len(values) // 2] * 1e3
        total_issue, total_done = total_issue + issued, total_done + done
        print(f"  {phase:16s} {issued:8.2f} {done:8.2f}")
    print(f"  {'sum':16s} {total_issue:8.2f} {total_done:8.2f}")


def unsynced_step_ms(step, batch, repeats=5) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(*batch)
    sync()
    return (time.perf_counter() - t0) / repeats * 1e3


def kernels(name, step, batch, top=18):
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(*batch)
        sync()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    launches = sum(e.count for e in events) / 2
    device_ms = sum(e.self_device_time_total for e in events) / 2 / 1e3
    print(f"--- {name}: {launches:.0f} device ops per step, {device_ms:.2f} ms of device time per step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.self_device_time_total / 2e3:8.2f} ms {e.count / 2:6.0f}x  {e.key[:110]}")


def main(preset, seq, mb, mode, chunk_mib=None, *overrides):
    seq, mb = int(seq), int(mb)
    chunk_mib = int(chunk_mib or 0)
    if chunk_mib:
        import meshlm.model.loss as loss

        loss.CHUNK_BYTES = loss.FUSED_CHUNK_BYTES = chunk_mib * 2**20
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    overrides = [f"model.preset={preset}", f"train.seq_len={seq}", f"train.micro_batch_size={mb}",
                 f"train.global_batch_size={mb}", "train.dtype=bfloat16", f"parallel.backend={backend}",
                 *overrides, *(["train.compile=true"] if mode == "compile" else [])]
    cfg = resolve(load_config(None, overrides))
    meshlm = MeshlmEngine(cfg, ParallelContext.from_config(cfg.parallel))
    reference = TransformersEngine(meshlm, "inductor" if mode == "compile" else None)
    device = meshlm.device
    batch = random_batch(0, mb, seq, cfg.model.vocab_size, device)
    tag = f"{preset} seq {seq} mb {mb} {mode}" + (f" chunk {chunk_mib} MiB" if chunk_mib else "")
    for _ in range(3):
        meshlm.step(*batch)
        reference.step(*batch)
    for name, engine in (("meshlm", meshlm), ("transformers", reference)):
        ms = unsynced_step_ms(engine.step, batch)
        print(f"=== {tag}: {name} {ms:.2f} ms/step unsynced, {mb * seq / ms * 1e3:,.0f} tokens/s")
    breakdown(f"{tag} meshlm", lambda b: meshlm_phases(meshlm, b), batch)
    breakdown(f"{tag} transformers", lambda b: reference_phases(reference, b), batch)
    kernels(f"{tag} meshlm", meshlm.step, batch)
    kernels(f"{tag} transformers", reference.step, batch)


if __name__ == "__main__":
    main(*sys.argv[1:])
