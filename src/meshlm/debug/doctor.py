"""`meshlm doctor`: the machine checked before a run, one line per check, ok or what to do.

Reduces: runs that die at start-up on their environment (too few GPUs, a busy port, a tiny /dev/shm,
ranks that cannot talk), found in seconds instead of after a launch and a traceback per rank.
Costs: a few seconds, nearly all of it the collective check, which starts `--nproc` local ranks.

Each check returns a `Check` (status ok, warn or fail; a fix whenever it is not ok). Exit 1 when
one fails, 0 otherwise: a warning is worth reading but does not stop a run. `gpu_shortfall` is
also the door check of `meshlm train` (cli.cmd_train), so both commands say the same thing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import resource
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from meshlm.errors import ConfigError
from meshlm.mesh import default_backend, nccl_usable

MIN_PYTHON = (3, 11)  # pyproject.toml's requires-python
MIN_SHM_BYTES = 1 << 30  # gloo, NCCL's intra-node transport and data-loader workers all use /dev/shm
MIN_OPEN_FILES = 4096  # every rank holds a socket per peer and group, plus dataset and checkpoint files
DEFAULT_PORT = 29500  # torch's MASTER_PORT default
MAX_TEST_RANKS = 8
SLOW_FRACTION = 0.25  # busbw below this share of the cost model's figure is worth a warning


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------- GPUs and backend (pure)


def gpu_shortfall(nproc: int, preference: str, *, nccl_ok: bool, n_gpus: int,
                  visible: str | None) -> tuple[str, str] | None:
    """(what is wrong, what to do) when `nproc` local ranks cannot run on the backend that
    `preference` (parallel.backend) resolves to here; None when they can. Pure: the machine's
    facts come in as arguments, so it is tested on a machine without GPUs."""
    backend = default_backend(preference, nccl_ok=nccl_ok)
    if backend != "nccl":
        return None  # gloo runs any number of ranks on the CPU
    if not nccl_ok:
        why = "no visible CUDA GPU" if n_gpus == 0 else "this torch was built without NCCL"
        return (f"parallel.backend=nccl: NCCL cannot run here ({why})",
                "use parallel.backend=gloo (or auto) to run on the CPU")
    if n_gpus >= nproc:
        return None
    shown = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "CUDA_VISIBLE_DEVICES not set"
    return (f"--nproc {nproc}: this machine has {n_gpus} visible GPU{'' if n_gpus == 1 else 's'} ({shown}); "
            f"NCCL needs one GPU per rank",
            f"use --nproc {n_gpus}, or parallel.backend=gloo to run on the CPU")


def local_gpu_shortfall(nproc: int, preference: str) -> tuple[str, str] | None:
    """`gpu_shortfall` with this machine's facts."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpu_shortfall(nproc, preference, nccl_ok=nccl_usable(), n_gpus=n_gpus,
                         visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


# --------------------------------------------------------------------------- the checks


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < MIN_PYTHON:
        return Check("python", "fail", f"{version}; meshlm needs >= {'.'.join(map(str, MIN_PYTHON))}",
                     "install Python 3.11 or newer and recreate the virtual environment")
    return Check("python", "ok", version)


def pinned_torch() -> str | None:
    """The torch version meshlm pins (pyproject.toml, through the installed metadata)."""
    try:
        requires = importlib.metadata.requires("meshlm") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((r.split("==", 1)[1].strip() for r in requires if r.replace(" ", "").startswith("torch==")), None)


def check_torch() -> Check:
    version, pin = torch.__version__, pinned_torch()
    if pin is None:
        return Check("torch", "ok", f"{version} (meshlm's pin unknown: not installed with pip)")
    if version.split("+")[0] != pin:  # "+cpu" / "+cu128": the build, not the version
        return Check("torch", "warn", f"{version}; meshlm is tested with {pin}",
                     f"pip install torch=={pin} (for GPUs, the CUDA build from download.pytorch.org)")
    return Check("torch", "ok", version)


def check_cuda() -> Check:
    if torch.version.cuda is None:
        if shutil.which("nvidia-smi"):  # a GPU driver is here, but this torch cannot use it
            return Check("cuda", "warn", "this torch is a CPU build, but nvidia-smi is installed",
                         "install the CUDA build of torch to train on the GPUs")
        return Check("cuda", "ok", "CPU build of torch: ranks run on the CPU with gloo")
    if not torch.cuda.is_available():
        return Check("cuda", "warn", f"CUDA {torch.version.cuda} build, but no usable GPU "
                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'not set')})",
                     "check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES; until then runs use the CPU")
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return Check("cuda", "ok", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {', '.join(names)}")


def check_nccl() -> Check:
    if not torch.cuda.is_available():
        return Check("nccl", "ok", "not needed: no CUDA GPU, so collectives use gloo")
    if not dist.is_nccl_available():
        return Check("nccl", "warn", "this torch was built without NCCL: GPU runs would fall back to gloo",
                     "install a CUDA build of torch with NCCL (the official wheels have it)")
    version = torch.cuda.nccl.version()
    return Check("nccl", "ok", "NCCL " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version)))


def check_gpus(nproc: int, preference: str) -> Check:
    shortfall = local_gpu_shortfall(nproc, preference)
    if shortfall:
        return Check("gpus", "fail", *shortfall)
    backend = default_backend(preference)
    if backend == "nccl":
        return Check("gpus", "ok", f"{torch.cuda.device_count()} visible, enough for --nproc {nproc} on NCCL")
    return Check("gpus", "ok", f"--nproc {nproc} on gloo: ranks run on the CPU ({os.cpu_count()} cores)")


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        stat = os.statvfs(path)
    except OSError:
        return Check("shm", "warn", f"no {path}: gloo and data-loader workers cannot share memory through it",
                     "on Linux, mount a tmpfs at /dev/shm (containers: docker run --shm-size=8g)")
    free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    detail = f"{path}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
    if free < MIN_SHM_BYTES:
        return Check("shm", "warn", detail + f", below {MIN_SHM_BYTES / 2**30:.0f} GiB (NCCL and gloo buffers, "
                     "data-loader batches live there)",
                     "containers: docker run --shm-size=8g (or --ipc=host); "
                     "hosts: sudo mount -o remount,size=8G /dev/shm")
    return Check("shm", "ok", detail)


def check_open_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        fix = (f"ulimit -n {target} in the shell that starts meshlm" if target >= MIN_OPEN_FILES else
               f"the hard limit ({hard}) is too low too: raise nofile in /etc/security/limits.conf")
        return Check("open_files", "warn", f"limit {soft} (hard {shown}), below {MIN_OPEN_FILES}: "
                     "sockets per peer and group run out at scale", fix)
    return Check("open_files", "ok", f"limit {soft} (hard {shown})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int, explicit: bool) -> Check:
    """Whether the rendezvous can listen on `port`. Single-node `meshlm train` picks a free port
    itself (torchrun --standalone), so a busy default port is a warning; one asked for, a failure."""
    try:
        with socket.socket() as s:
            # As torch's TCPStore does: a port left in TIME_WAIT by a finished run is free to it.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    except OSError as e:
        other = _free_port()
        fix = (f"use a free port, e.g. --rdzv-endpoint HOST:{other} (multi-node) or MASTER_PORT={other}; "
               f"`ss -ltnp | grep :{port}` shows who holds {port}")
        if not explicit:
            fix += "; single-node meshlm train picks a free port itself"
        return Check("port", "fail" if explicit else "warn", f"127.0.0.1:{port} cannot be bound: {e.strerror}", fix)
    return Check("port", "ok", f"127.0.0.1:{port} is free for the rendezvous")


# --------------------------------------------------------------------------- the collective check


def _time_all_reduce(nbytes: int, iters: int) -> dict:
    """One rank's part of the collective check (in a forked, or for CUDA spawned, rank)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)  # before the first collective: NCCL binds its communicator to it
    x = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(x)  # warm-up: gloo pairs and NCCL communicators are set up on first use
    correct = bool((x == n).all())  # ranks that talk but sum wrongly are worse than ranks that hang
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / iters
    return {"seconds": seconds, "correct": correct,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def predicted_topology(backend: str, device_name: str):
    """The cost model's topology for these local ranks: gloo's measured loopback, or the GPU's node."""
    from meshlm.analysis.hardware import GPUS
    from meshlm.comm.cost import HARDWARE

    if backend != "nccl":
        return HARDWARE["cpu-loopback"]
    if "PCIe" in device_name:  # an H100 PCIe card has no NVLink to its neighbours
        return HARDWARE["pcie"]
    gpu = next((g for g in GPUS.values() if g.peak_key in device_name), None)
    return gpu.topology() if gpu else HARDWARE["pcie"]


def check_collective(nranks: int, backend: str) -> Check:
    from meshlm.comm.cost import bus_factor
    from meshlm.testing import RankFailure, RankTimeout, run_ranks

    if nranks == 0:
        return Check("collective", "warn", f"skipped: no device for a rank on {backend}", "fix the gpus check first")
    if nranks == 1:
        return Check("collective", "ok", f"1 rank on {backend}: nothing to exchange (--nproc 2 or more tests one)")
    nbytes, iters = (32 << 20, 10) if backend == "nccl" else (4 << 20, 5)
    try:  # a CUDA rank cannot be forked from a parent that has touched CUDA: spawn those
        results = run_ranks(_time_all_reduce, nranks, nbytes, iters, backend=backend, timeout=60,
                            start_method="spawn" if backend == "nccl" else "fork")
    except RankTimeout:
        return Check("collective", "fail", f"{nranks} local ranks on {backend} still in all_reduce after 60 s",
                     "ranks cannot reach each other: set GLOO_SOCKET_IFNAME=lo / NCCL_SOCKET_IFNAME=lo, "
                     "NCCL_DEBUG=INFO says why")
    except RankFailure as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1].strip()
        return Check("collective", "fail", f"all_reduce on {nranks} local ranks ({backend}) failed: {last}",
                     "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL for the cause")
    if not all(r["correct"] for r in results):
        return Check("collective", "fail", f"all_reduce on {nranks} local ranks ({backend}) returned a wrong sum",
                     "a broken transport: try NCCL_P2P_DISABLE=1, or NCCL_SHM_DISABLE=1, and report it")
    seconds = max(r["seconds"] for r in results)  # a collective ends when its slowest rank does
    measured = bus_factor("all_reduce", nranks) * nbytes / seconds
    topology = predicted_topology(backend, results[0]["device"])
    predicted = bus_factor("all_reduce", nranks) * nbytes / topology.time("all_reduce", nbytes, nranks)
    detail = (f"{nranks} ranks on {backend}: all_reduce {nbytes >> 20} MiB in {seconds * 1e3:.2f} ms, "
              f"busbw {measured / 1e9:.2f} GB/s; cost model ({topology.name}) {predicted / 1e9:.2f} GB/s, "
              f"measured {measured / predicted:.0%} of it")
    if measured < SLOW_FRACTION * predicted:
        return Check("collective", "warn", detail,
                     "other load on the machine, or a slow transport (NCCL_DEBUG=INFO names it); "
                     "meshlm bench comm measures a full profile for the planner")
    return Check("collective", "ok", detail)


# --------------------------------------------------------------------------- the command


def run_checks(nproc: int | None, preference: str, port: int | None) -> list[Check]:
    backend = default_backend(preference)
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl":  # one GPU per rank
        wanted = nproc or n_gpus
        test_ranks = min(wanted, n_gpus if nccl_usable() else 0, MAX_TEST_RANKS)
    else:
        wanted = nproc or 2
        test_ranks = min(wanted, MAX_TEST_RANKS)
    env_port = os.environ.get("MASTER_PORT")
    explicit = port is not None or env_port is not None
    port = port if port is not None else int(env_port or DEFAULT_PORT)
    return [check_python(), check_torch(), check_cuda(), check_nccl(), check_gpus(wanted, preference),
            check_shm(), check_open_files(), check_port(port, explicit), check_collective(test_ranks, backend)]


def format_check(check: Check) -> str:
    line = f"{check.status if check.status != 'fail' else 'FAIL':<5} {check.name:<11} {check.detail}"
    return line + (f" -> {check.fix}" if check.fix else "")


def run(args) -> int:
    """`meshlm doctor`: 0 when every check is ok or only warns, 1 when one fails."""
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {args.nproc}")
    if args.port is not None and not 0 < args.port < 65536:
        raise ConfigError(f"--port: must be in 1..65535, got {args.port}")
    env_port = os.environ.get("MASTER_PORT")  # what torchrun and the ranks would use without --port
    if args.port is None and env_port is not None and not (env_port.isdigit() and 0 < int(env_port) < 65536):
        raise ConfigError(f"MASTER_PORT: must be a port in 1..65535, got {env_port!r}")
    checks = run_checks(args.nproc, args.backend, args.port)
    ok = all(c.status != "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}))
    else:
        for check in checks:
            print(format_check(check))
        failed = sum(c.status == "fail" for c in checks)
        warned = sum(c.status == "warn" for c in checks)
        print(f"meshlm doctor: {failed} failed, {warned} warning(s)" if failed or warned else "meshlm doctor: all ok")
    return 0 if ok else 1
