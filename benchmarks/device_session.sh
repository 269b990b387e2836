#!/usr/bin/env bash
# What a session lent the GPU machine runs there (each `run` call may take at most 10 minutes, and a
# session has 30 minutes of device time in all), from the repository root. Parts:
#
#   check     (~3 min)  the machine, versions, CUDA-only tests, compile tests
#   train     (~2 min)  meshlm train on the GPU: 125m, bf16, compiled
#   gpu-1b    (~3 min)  meshlm bench gpu, 1b at seq 2048, micro-batch 4 (the MFU target)
#   gpu-125m  (~3 min)  meshlm bench gpu, 125m at micro-batches 8 and 16, eager + compile
#   scaling   (~3 min)  meshlm bench scaling --nproc 1,2,4,8 (CPU ranks on the 16 cores, no GPU)
#
# A machine stays warm only ~30 s after a call (issue the next call at once), and each fresh start
# costs 1-2 minutes of the 30: make as few calls as fit, then `give_back`. Session 21 measured
# everything here once (RESULTS.md); what the next session needs, in this order:
#
#   run: bash benchmarks/device_session.sh check gpu-1b gpu-125m   (~9 min: the CUDA tests'
#        outcomes, and both targets on the landed code, whole-forward compile included)
#   run: PYTHONPATH=src python3 benchmarks/gpu_profile.py 125m 1024 8 compile   (if 125m still
#        misses: where its host time goes)
#   run: bash benchmarks/device_session.sh train scaling                    (~5 min, if time is left)
#
# Each writes its JSON (and the scaling plot) under $OUT, which comes back; bench gpu also prints
# every row on stderr as it lands, so a call cut short still shows what it measured. The machine's
# python3 has a CUDA torch, transformers and safetensors: run from src/, never `pip install -e .`
# (pyproject pins the CPU torch, and the machine has no network). Record every result with its
# device in benchmarks/RESULTS.md.
set -u
export PYTHONPATH=src
# No network there: pip (the default corpus's download) fails at once instead of timing out.
export PIP_NO_INDEX=1
OUT=${OUT:-/tmp/meshlm-device-out}
mkdir -p "$OUT"
meshlm() { python3 -m meshlm.cli "$@"; }

part() {
case "$1" in
check)
    nproc; lscpu -e=CPU,CORE,SOCKET | head -20; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
    df -h /dev/shm | tail -1
    python3 - <<'EOF'
import os, sysconfig, shutil, torch, transformers, torch.distributed as dist
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("all_gather_single in this torch:", hasattr(dist, "all_gather_single"))
print("C compiler for Triton:", shutil.which("cc") or shutil.which("gcc"),
      "Python.h:", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))
x = torch.ones(8, device="cuda")
print("torch.compile on CUDA works:", torch.compile(lambda t: (t * 2).sin())(x).sum().item())
EOF
    if python3 -c "import pytest" 2>/dev/null; then
        # The CUDA-only tests (skipped on CPU machines): the flash ring-attention blocks.
        # (Session 21 saw neither run print its summary line, and this one print nothing: -rA names
        # each test's outcome, and the exit status is printed.)
        python3 -m pytest -rA -p no:cacheprovider tests/test_context_parallel.py -k cuda 2>&1 | tail -30
        echo "pytest rc=${PIPESTATUS[0]}"
        # This torch's dynamo on meshlm's blocks (one graph for all of them, the loss kernels),
        # with CUDA hidden: the tests count CPU steps and fork gloo ranks, which CUDA would break.
        CUDA_VISIBLE_DEVICES= python3 -m pytest -rA -p no:cacheprovider tests/test_compile.py 2>&1 | tail -30
        echo "pytest rc=${PIPESTATUS[0]}"
    else
        echo "no pytest here: the CUDA-only tests did not run"
    fi
    ;;
train)
    # The trainer's own CUDA path end to end (fused AdamW over the flat buffers, per-block compile,
    # the chunked loss; one rank: no process group, so no NCCL collective runs, and no overlap or
    # stall accounting is exercised: NCCL refuses two ranks on one GPU). Offline, the corpus falls
    # back to the Python docs' text, whose held-out 1% is shorter than one 1,025-token window:
    # a larger validation split (session 21's first try stopped on that one-line error).
    # Its metrics rows (tokens/s, mfu, mem_peak_bytes) land in $OUT/train/metrics.jsonl.
    meshlm train run.dir="$OUT/train" checkpoint.interval=0 train.steps=40 train.log_interval=5 \
        model.preset=125m train.seq_len=1024 train.micro_batch_size=8 train.global_batch_size=8 \
        train.dtype=bfloat16 train.compile=true data.val_fraction=0.05 2>&1 | tail -25
    rm -rf "$OUT/train/final"  # the weights: too large to bring back, and not needed
    ;;
gpu-125m)
    # The loss alone first (seconds): eager chunks against train.compile's fused ones, at the 125m
    # row's logits (8 x 1,024 rows x 32,000); RESULTS.md predicts ~4 ms a step saved on an H100.
    python3 benchmarks/loss_kernels.py 8192 32000 bfloat16 inductor cuda
    meshlm bench gpu --presets 125m --seq 1024 --micro-batch 8,16 --json > "$OUT/gpu-125m.json"; echo "rc=$?"
    cat "$OUT/gpu-125m.json" | python3 -c "import json,sys; [print(r['name'], round(r['tokens_per_s_ratio'],3), r['mfu']) for r in json.load(sys.stdin)['rows']]"
    ;;
gpu-1b)
    meshlm bench gpu --presets 1b --seq 2048 --json > "$OUT/gpu-1b.json"; echo "rc=$?"
    cat "$OUT/gpu-1b.json" | python3 -c "import json,sys; [print(r['name'], round(r['tokens_per_s_ratio'],3), r['mfu']) for r in json.load(sys.stdin)['rows']]"
    ;;
scaling)
    # CPU ranks on the machine's 16 cores (one per rank, pinned): W = 1, 2, 4, 8.
    meshlm bench scaling --nproc 1,2,4,8 --json --plot "$OUT/scaling-weak-tiny-w1-8.png" > "$OUT/scaling.json"
    echo "rc=$?"
    MESHLM_SHM_DISABLE=1 meshlm bench scaling --nproc 2,8 --engines ddp --steps 4 --json > "$OUT/scaling-gloo.json"
    echo "rc=$? (gloo's collectives, with their background thread, for comparison)"
    ;;
*)
    echo "usage: bash benchmarks/device_session.sh PART... (PART: check, train, gpu-1b, gpu-125m, scaling)" >&2
    exit 2
    ;;
esac
}

[ $# -ge 1 ] || part usage
for name in "$@"; do  # every name checked before anything runs: a typo costs no device time
    case "$name" in check|train|gpu-1b|gpu-125m|scaling) ;; *) part usage ;; esac
done
for name in "$@"; do
    echo "=== $name ==="
    part "$name"
done
