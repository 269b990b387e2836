"""`meshlm doctor` (each check ok, or what to do) and the GPU check at the door of `meshlm train`.

The GPU cases run on a CPU machine: torch's CUDA probes are monkeypatched to describe one GPU,
and the door check must refuse before anything is written or any rank starts."""

import json
import socket

import pytest
import torch
import torch.distributed as dist

from meshlm import cli
from meshlm.comm.cost import HARDWARE, bus_factor
from meshlm.config import load_config
from meshlm.debug import doctor
from meshlm.debug.doctor import Check, gpu_shortfall
from meshlm.mesh import Layout, ParallelContext, default_backend

CHECKS = ["python", "torch", "cuda", "nccl", "gpus", "shm", "open_files", "port", "collective"]
ONE_GPU_MESSAGE = ("--nproc 2: this machine has 1 visible GPU (CUDA_VISIBLE_DEVICES=0); NCCL needs one GPU per "
                   "rank: use --nproc 1, or parallel.backend=gloo to run on the CPU")


def _listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _free_port() -> int:
    with _listening_socket() as s:
        return s.getsockname()[1]


def test_doctor_names_every_check_and_measures_busbw_against_the_cost_model(capsys):
    assert cli.main(["doctor", "--json", "--nproc", "2", "--backend", "gloo", "--port", str(_free_port())]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert [c["name"] for c in report["checks"]] == CHECKS
    for check in report["checks"]:
        assert set(check) == {"name", "status", "detail", "fix"}
        assert check["status"] in ("ok", "warn") and bool(check["fix"]) == (check["status"] != "ok"), check
    collective = report["checks"][-1]["detail"]
    assert collective.startswith("2 ranks on gloo: all_reduce 4 MiB in ") and "busbw" in collective
    nbytes = 4 << 20  # the model's figure, computed here from the cost model itself
    predicted = bus_factor("all_reduce", 2) * nbytes / HARDWARE["cpu-loopback"].time("all_reduce", nbytes, 2)
    assert f"cost model (cpu-loopback) {predicted / 1e9:.2f} GB/s" in collective


def _no_collective(monkeypatch):
    """The collective check forks ranks; the test above runs it once, the others stub it."""
    monkeypatch.setattr(doctor, "check_collective", lambda nranks, backend: Check("collective", "ok", "stubbed"))


@pytest.mark.parametrize("value", ["abc", "99999"])
def test_a_master_port_that_is_no_port_is_one_line_and_exit_2(monkeypatch, capsys, value):
    from meshlm.cli import main

    monkeypatch.setenv("MASTER_PORT", value)
    assert main(["doctor", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"meshlm: error: MASTER_PORT: must be a port in 1..65535, got '{value}'"


def test_a_port_in_use_fails_with_what_to_do_and_exit_1(monkeypatch, capsys):
    _no_collective(monkeypatch)
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        assert cli.main(["doctor", "--port", str(port)]) == 1
        lines = capsys.readouterr().out.splitlines()
        assert cli.main(["doctor", "--json", "--port", str(port)]) == 1
        report = json.loads(capsys.readouterr().out)
        busy_default = doctor.check_port(port, explicit=False)
    assert len(lines) == len(CHECKS) + 1  # one line per check, then the summary
    (port_line,) = [line for line in lines if line.split()[1] == "port"]
    assert port_line.startswith(f"FAIL  port        127.0.0.1:{port} cannot be bound")
    assert "--rdzv-endpoint HOST:" in port_line and "MASTER_PORT=" in port_line
    assert lines[-1].startswith("meshlm doctor: 1 failed")
    assert report["ok"] is False
    (port_check,) = [c for c in report["checks"] if c["name"] == "port"]
    assert port_check["status"] == "fail" and "MASTER_PORT=" in port_check["fix"]
    # The default port busy is a warning: single-node meshlm train picks a free port itself.
    assert busy_default.status == "warn" and "picks a free port itself" in busy_default.fix
    assert doctor.check_port(_free_port(), explicit=True).status == "ok"


@pytest.mark.parametrize("nproc, preference, nccl_ok, n_gpus, refused", [
    (2, "auto", True, 1, "--nproc 2: this machine has 1 visible GPU"),
    (3, "nccl", True, 2, "--nproc 3: this machine has 2 visible GPUs"),
    (2, "auto", True, 2, None),
    (8, "gloo", True, 1, None),  # gloo asked for: the CPU runs any number of ranks
    (2, "auto", False, 0, None),  # no CUDA: auto is gloo
    (1, "nccl", False, 0, "parallel.backend=nccl: NCCL cannot run here (no visible CUDA GPU)"),
    (1, "nccl", False, 1, "parallel.backend=nccl: NCCL cannot run here (this torch was built without NCCL)"),
])
def test_gpu_shortfall(nproc, preference, nccl_ok, n_gpus, refused):
    shortfall = gpu_shortfall(nproc, preference, nccl_ok=nccl_ok, n_gpus=n_gpus, visible="0")
    if refused is None:
        assert shortfall is None
    else:
        problem, fix = shortfall
        assert problem.startswith(refused) and "gloo" in fix


@pytest.fixture
def one_gpu(monkeypatch):
    """This process believes it has one CUDA GPU with NCCL (nothing may actually use it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")


class Started(Exception):
    """The door check let the run through (raised where ranks would begin to be prepared)."""


@pytest.fixture
def no_start(monkeypatch):
    import meshlm.train.checkpoint.resume as resume

    def started(*_, **__):
        raise Started

    monkeypatch.setattr(resume, "precheck", started)


def test_train_with_more_ranks_than_gpus_is_one_line_and_exit_2(one_gpu, no_start, tmp_path, capsys):
    assert cli.main(["train", "--nproc", "2", f"run.dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == f"meshlm: error: {ONE_GPU_MESSAGE}\n"
    assert not any(tmp_path.iterdir())  # refused before the config was written
    for allowed in (["--nproc", "2", "parallel.backend=gloo"], ["--nproc", "1"]):
        with pytest.raises(Started):
            cli.main(["train", *allowed, f"run.dir={tmp_path}"])
    check = doctor.check_gpus(2, "auto")
    assert (check.status, f"{check.detail}: {check.fix}") == ("fail", ONE_GPU_MESSAGE)
    assert doctor.check_gpus(2, "gloo").status == "ok"


def test_nccl_asked_for_without_cuda_is_one_line_and_exit_2(monkeypatch, no_start, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["train", f"run.dir={tmp_path}", "parallel.backend=nccl"]) == 2
    assert capsys.readouterr().err == ("meshlm: error: parallel.backend=nccl: NCCL cannot run here (no visible CUDA "
                                       "GPU): use parallel.backend=gloo (or auto) to run on the CPU\n")


def test_gloo_asked_for_on_a_gpu_machine_runs_on_the_cpu(one_gpu):
    assert default_backend() == "nccl" and default_backend("gloo") == "gloo"
    ctx = ParallelContext.from_config(load_config(None, ["parallel.backend=gloo"]).parallel)
    assert (ctx.backend, ctx.device.type) == ("gloo", "cpu")
    assert ParallelContext(Layout(), backend="gloo").device.type == "cpu"
