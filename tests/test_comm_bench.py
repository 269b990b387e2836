"""`meshlm bench comm`: bad usage, the measured table and fitted profile, the tracing overhead it
reports, and the meshlm transport's own timings."""

import pytest
import torch
import torch.distributed as dist

from meshlm.comm import Handle
from meshlm.comm.cost import bus_factor, load_profile
from meshlm.mesh import Layout, ParallelContext
from meshlm.testing import run_ranks


def test_bench_parses_sizes_and_rejects_bad_usage_with_exit_2(capsys):
    from meshlm.comm.bench import main, parse_size

    assert [parse_size(s) for s in ("4096", "64K", "1M", "2MiB")] == [4096, 65536, 2**20, 2**21]
    assert main(["--nproc", "1"]) == 2
    assert main(["--ops", "all_reduce,gossip"]) == 2
    assert main(["--sizes", "lots"]) == 2
    assert main(["--bogus"]) == 2
    assert main(["--min-bytes", "0"]) == 2  # doubling 0 would never reach --max-bytes: a hang
    err = capsys.readouterr().err
    assert "--nproc: needs at least 2 ranks" in err and "unknown ['gossip']" in err and "not a size" in err
    assert "--min-bytes: must be at least 1 byte, got '0'" in err


def test_bench_measures_fits_and_saves_a_profile(tmp_path, capsys):
    import json

    from meshlm.comm.bench import main

    profile = tmp_path / "profile.json"
    args = ["--sizes", "4K,256K", "--ops", "all_reduce,all_gather,p2p", "--trials", "2", "--max-iters", "2"]
    assert main([*args, "--json", "--save-profile", str(profile)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rows"]) == 6 and report["world_size"] == 2
    for row in report["rows"]:
        for key in ("name", "op", "bytes", "world_size", "time_s", "algbw", "busbw", "predicted_time_s"):
            assert key in row
        assert row["busbw"] == pytest.approx(row["algbw"] * bus_factor(row["op"], 2))
    assert set(report["fit"]) == {"all_reduce", "all_gather", "p2p"}
    assert report["tracing_overhead"]["bookkeeping_s"] > 0
    saved = load_profile(profile)
    assert set(saved.op_links) == {"all_reduce", "all_gather"} and saved.intra.bandwidth_Bps > 0
    # Predict with the saved profile instead of a fresh fit: an out-of-sample check.
    assert main([*args, "--profile", str(profile), "--no-overhead"]) == 0
    table = capsys.readouterr().out
    assert "busbw(GB/s)" in table and "model measured-gloo-2" in table


def _overhead_rank():
    from meshlm.comm import shared_memory
    from meshlm.comm.bench import _tracing_overhead

    opened = []
    real_open = shared_memory.SharedWindow.open
    shared_memory.SharedWindow.open = classmethod(lambda cls, *a, **k: opened.append(a) or real_open(*a, **k))
    ctx = ParallelContext(Layout(dp=dist.get_world_size()))
    return _tracing_overhead(ctx, iters=40), len(opened)


def test_tracing_overhead_is_measured_around_the_library_op():
    """The bookkeeping loop replaces the library's all_reduce with a no-op: it must be the op the
    traced Comm calls there (no shared-memory window), or the loop times real communication."""
    for overhead, windows_opened in run_ranks(_overhead_rank, 2):
        assert windows_opened == 0 and overhead["bookkeeping_s"] > 0


def test_bench_transport_meshlm_times_comm_and_names_its_profile(tmp_path, capsys):
    import json

    from meshlm.comm.bench import OPS, _make_op, main

    class Calls:  # stands in for Comm: which of its ops each timed closure runs
        def __getattr__(self, name):
            return lambda *args, **kwargs: seen.append(name) or Handle((), (), None)

    seen = []
    for op in OPS:
        fn, _ = _make_op(op, 4096, 2, 0, torch.device("cpu"), Calls())
        fn()
    assert seen == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "batch_isend_irecv"]
    profile = tmp_path / "profile.json"
    args = ["--sizes", "4K,2M", "--ops", "all_reduce,reduce_scatter", "--trials", "2", "--max-iters", "2",
            "--no-overhead", "--transport", "meshlm"]
    assert main([*args, "--json", "--save-profile", str(profile)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["transport"] == "meshlm" and len(report["rows"]) == 4
    assert report["meshlm_ops"] >= 4 * 2 * 2  # every timed op went through Comm (and its warm-ups)
    saved = load_profile(profile)
    assert saved.name == "measured-gloo-meshlm-2"
    assert report["shared_memory"] and not saved.background  # its collectives run when waited


def _synthetic(sizes, noise=0.1):
    # all_reduce times off a line by +-noise: a two-point fit would pass through any two of them
    rows = [{"op": "all_reduce", "bytes": s, "world_size": 2, "count": s // 4,
             "time_s": (1e-5 + s / 1e9) * (1 + noise * (-1) ** i)} for i, s in enumerate(sizes)]
    return {"rows": rows, "backend": "gloo", "device": "cpu", "tracing_overhead": None}


def test_fit_quality_is_null_unless_three_sizes_above_the_floor_judge_it():
    """In sample, two sizes fit exactly: the fit's error was 0% whatever the measurements."""
    from meshlm.comm.bench import analyse, format_table

    two = analyse(_synthetic([4096, 65536, 2**20]))  # one size below the 64 KiB floor
    assert two["median_rel_err_ge_64KiB"] is None and two["median_rel_err_ge_64KiB_by_op"] == {"all_reduce": None}
    assert "64 KiB: n/a" in format_table(two)
    three = analyse(_synthetic([65536, 2**20, 2**22]))
    assert three["median_rel_err_ge_64KiB"] is not None and three["median_rel_err_ge_64KiB_by_op"]["all_reduce"] > 0
    # a saved profile is judged out of sample, on any number of sizes
    from meshlm.comm.cost import HARDWARE

    assert analyse(_synthetic([65536, 2**20]), HARDWARE["cpu-shm"])["median_rel_err_ge_64KiB"] is not None


def test_an_empty_size_range_names_max_bytes(capsys):
    from meshlm.comm.bench import main

    assert main(["--max-bytes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("meshlm bench comm: error: --max-bytes: ")


def test_every_row_carries_the_bench_schema():
    """DESIGN.md: every `meshlm bench --json` row has at least these fields; a collective has no
    tokens and no paired implementation, so they are null here."""
    from meshlm.comm.bench import analyse

    schema = ("name", "world_size", "meshlm_tokens_per_s", "reference", "reference_tokens_per_s",
              "tokens_per_s_ratio", "meshlm_peak_bytes", "reference_peak_bytes", "memory_ratio")
    for row in analyse(_synthetic([65536, 2**20, 2**22]))["rows"]:
        assert all(key in row for key in schema), [key for key in schema if key not in row]
