"""`meshlm bench scaling`: its arithmetic (efficiency, oversubscription, batch sizes) as pure
functions, and one tiny end-to-end run (W = 1, 2, debug preset) for the --json schema and --plot.
The measured numbers live in benchmarks/RESULTS.md, not here."""

import json

import pytest

from meshlm.bench import scaling
from meshlm.bench.scaling import global_rows, oversubscribed, oversubscription_note, scaling_efficiency

from helpers import host_memory_tuning_recorder

DESIGN_FIELDS = {"name", "world_size", "meshlm_tokens_per_s", "reference", "reference_tokens_per_s",
                 "tokens_per_s_ratio", "meshlm_peak_bytes", "reference_peak_bytes", "memory_ratio"}


def test_scaling_efficiency_is_throughput_over_w_times_the_one_rank_point():
    # Weak scaling: the meshlm DDP points against a one-rank 3,500 tokens/s.
    assert scaling_efficiency(6839, 2, 3500) == pytest.approx(6839 / 7000)
    assert scaling_efficiency(26149, 8, 3500) == pytest.approx(0.93389, abs=1e-5)
    assert scaling_efficiency(3500, 1, 3500) == 1.0
    # Strong scaling: one rank trains the whole global batch at 4,000 tokens/s; 4 ranks at 12,000
    # are a speedup of 3, an efficiency of 3 / 4.
    assert scaling_efficiency(12000, 4, 4000) == pytest.approx(0.75)


def test_global_batch_grows_with_w_in_weak_scaling_only():
    assert [global_rows("weak", w, 8, 64) for w in (1, 2, 8)] == [8, 16, 64]
    assert [global_rows("strong", w, 8, 64) for w in (1, 2, 8)] == [64, 64, 64]


def test_oversubscription_is_more_ranks_than_cores():
    assert not oversubscribed(2, 2) and oversubscribed(3, 2) and not oversubscribed(8, 16)
    assert not oversubscribed(64, None)  # unknown core count: no claim
    assert oversubscription_note([1, 2], 2) is None
    note = oversubscription_note([1, 2, 4, 8], 2)
    assert note.startswith("W=4, 8 > 2 CPU cores: oversubscribed")
    assert oversubscription_note([2, 4], 1).startswith("W=2, 4 > 1 CPU cores")
    assert oversubscription_note([1, 2, 4], 4) is None and oversubscription_note([8], None) is None


def test_usage_errors_exit_2_before_any_rank_starts(capsys):
    assert scaling.main(["--mode", "strong", "--nproc", "1,3", "--global-batch", "4"]) == 2
    assert scaling.main(["--engines", "ddp,pp"]) == 2
    assert scaling.main(["--nproc", "1,x"]) == 2
    assert scaling.main(["--preset", "nope", "--nproc", "1"]) == 2
    assert "nope" in capsys.readouterr().err


def test_bench_scaling_json_and_plot(tmp_path, capsys, monkeypatch):
    # One core claimed, so W=2 is an oversubscribed point: the flag and the note must say so.
    monkeypatch.setattr(scaling, "usable_cores", lambda: 1)
    tuned = host_memory_tuning_recorder(monkeypatch, tmp_path)
    png = tmp_path / "scaling.png"
    # zero3 runs bench dp's engines exactly as ddp does (another stage), so the test leaves it out.
    assert scaling.main(["--nproc", "1,2", "--engines", "ddp,tp", "--steps", "1", "--warmup", "0", "--preset", "debug",
                         "--seq", "16", "--batch", "2", "--json", "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in report["rows"]] == ["ddp-w1", "tp-w1", "ddp-w2", "tp-w2"]
    assert [r["reference"] for r in report["rows"][:2]] == ["torch DDP", "DTensor TP+SequenceParallel"]
    base = report["baseline_tokens_per_s"]
    assert base > 0 and report["mode"] == "weak" and report["cpu_count"] == 1
    for row in report["rows"]:
        w = row["world_size"]
        assert DESIGN_FIELDS <= set(row) and row["meshlm_peak_bytes"] > 0 and row["reference_peak_bytes"] > 0
        assert row["global_batch"] == 2 * w
        assert row["oversubscribed"] == (w > 1)
        assert row["meshlm_efficiency"] == pytest.approx(row["meshlm_tokens_per_s"] / (w * base))
        assert row["reference_efficiency"] == pytest.approx(row["reference_tokens_per_s"] / (w * base))
        assert 0 <= row["meshlm_peer_wait_share"] <= row["meshlm_exposed_comm_share"] < 1
        assert row["predicted_tokens_per_s"] > 0
        if w == 1:  # calibrated on the one-rank point, and one rank communicates nothing
            assert row["predicted_tokens_per_s"] == pytest.approx(base) and row["meshlm_exposed_comm_share"] == 0
        if row["engine"] == "tp":
            assert row["reference_exposed_comm_share"] is None
            assert row["reference_exposed_comm_method"].startswith("null: ")
        else:
            assert 0 <= row["reference_exposed_comm_share"] < 1
    assert any(n.startswith("W=2 > 1 CPU cores: oversubscribed") for n in report["notes"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(tuned()) >= 2  # every CPU rank, at W=1 and W=2, set up as `meshlm train`'s
