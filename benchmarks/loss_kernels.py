"""The chunked loss's forward + backward, eager chunk maths against compiled (train.compile).

    PYTHONPATH=src .venv/bin/python benchmarks/loss_kernels.py [ROWS] [VOCAB] [DTYPE] [BACKEND] [DEVICE]

(defaults 4096 32000 bfloat16 inductor cpu). Times `token_loss_sum(consume_logits=True)` as the trainer calls it
(logits consumed, gradient written over them), the two sides alternating, median of 9 after 2
warm-up rounds, one thread on a CPU; prints both, their ratio and the largest gradient difference.
"""

import statistics
import sys
import time

import torch

from meshlm.model.loss import token_loss_sum
from meshlm.parallel.compile import compile_loss_kernels


def main() -> None:
    rows, vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 4096, int(sys.argv[2]) if len(sys.argv) > 2 else 32000
    dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
    backend = sys.argv[4] if len(sys.argv) > 4 else "inductor"
    device = torch.device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype).to(device)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    sides = {"eager": None, "compiled": compile_loss_kernels(backend)}
    times = {k: [] for k in sides}
    grads = {}

    def run(kernels):
        logits = base.clone().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        token_loss_sum(logits, targets, consume_logits=True, kernels=kernels).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, logits.grad

    for i in range(11):
        for name in (sides if i % 2 == 0 else list(sides)[::-1]):
            seconds, grads[name] = run(sides[name])
            if i >= 2:
                times[name].append(seconds)
    eager, compiled = (statistics.median(times[k]) for k in sides)
    diff = (grads["eager"].float() - grads["compiled"].float()).abs().max().item()
    print(f"{rows} x {vocab} {dtype} on {device} ({backend}): eager {eager * 1e3:.1f} ms, compiled {compiled * 1e3:.1f} ms, "
          f"eager/compiled {eager / compiled:.2f}x; largest gradient difference {diff:.2e}")


if __name__ == "__main__":
    main()
