"""Which checkpoints a start leaves where: the set-aside of another timeline's checkpoints, and what
a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0, set here by hand) finds after it. In this
process or one forked rank each: no torchrun (tests/test_checkpoint_cli.py runs it end to end)."""

import json

from meshlm.config import load_config

from helpers import build_trainer, small_cfg


def _fake_checkpoint(root, step):
    path = root / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
    return path


def test_two_set_asides_within_one_second_get_a_directory_each(tmp_path, monkeypatch):
    """Two fresh starts in a row within one second: the second renamed checkpoints/ onto the
    first's checkpoints.old-<second>, not empty: OSError (Directory not empty)."""
    import time

    from meshlm.train.checkpoint.resume import set_aside_old_checkpoints

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20250101-000000")  # one second, whatever the load
    cfg = load_config(None, [f"run.dir={tmp_path}", "checkpoint.resume=never"])
    asides = []
    for step in (2, 4):
        _fake_checkpoint(tmp_path / "checkpoints", step)  # the previous fresh start's save
        asides.append(set_aside_old_checkpoints(cfg, None))
    assert asides[0] != asides[1] and all(a.name.startswith("checkpoints.old-20250101-000000") for a in asides)
    assert [sorted(p.name for p in a.iterdir()) for a in asides] == [["step_0000002"], ["step_0000004"]]
