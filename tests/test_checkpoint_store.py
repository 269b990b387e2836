"""The checkpoint store on its own, in one process: the streamed safetensors writer against
safetensors' reader, the manifest and its checks (each way a file can be wrong, and the share of
files each rank hashes), finishing a save over an earlier one of the same step, rotation and
stale temporaries, discovery order, the rectangle reader across pieces, and the newest good
checkpoint. The end-to-end tests (resume, reshard, crashes) are in test_checkpoint*.py."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from meshlm.train.checkpoint.pieces import Rect
from meshlm.train.checkpoint.store import (FORMAT_VERSION, MANIFEST, META, CheckpointError, CheckpointReader,
                                           clear_stale_temporaries, finalize, list_checkpoints, newest_good,
                                           rank_file, read_manifest, read_meta, rotate, step_dir_name, verify,
                                           write_bytes_synced, write_safetensors, write_tensors_synced)

MIXED = {"f32": torch.arange(6, dtype=torch.float32).view(2, 3) / 7, "bf16": torch.linspace(-1, 1, 5).bfloat16(),
         "i64": torch.tensor([1, -2, 3]), "flag": torch.tensor([True, False, True]),
         "u8": torch.arange(5, dtype=torch.uint8), "scalar": torch.tensor(2.5, dtype=torch.float64)}


def test_streamed_safetensors_read_back_with_safetensors_and_its_entry_is_the_file(tmp_path):
    path = tmp_path / "t.safetensors"
    entry = write_tensors_synced(path, MIXED, {"note": "x"})
    data = path.read_bytes()
    assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for note in ("", "a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg"):  # every header length mod 8
        aligned = tmp_path / f"aligned{len(note)}.safetensors"
        write_tensors_synced(aligned, MIXED, {"note": note})
        assert int.from_bytes(aligned.read_bytes()[:8], "little") % 8 == 0  # the data starts 8-byte aligned
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"note": "x"} and set(f.keys()) == set(MIXED)
        for name, value in MIXED.items():
            got = f.get_tensor(name)
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), name


def test_a_tensor_unlike_its_header_entry_is_refused_by_name(tmp_path):
    layout = {"a": (torch.float32, (2, 2)), "b": (torch.float32, (3,))}
    with pytest.raises(ValueError, match=r"^b: got torch.float32 \(4,\)"):
        write_safetensors(tmp_path / "t.safetensors", layout,
                          lambda n: torch.zeros(2, 2) if n == "a" else torch.zeros(4))
    with pytest.raises(ValueError, match=r"^b: got torch.float32 \(2,\)"):  # shorter than the header says
        write_safetensors(tmp_path / "t.safetensors", layout,
                          lambda n: torch.zeros(2, 2) if n == "a" else torch.zeros(2))
    with pytest.raises(ValueError, match=r"^a: got torch.float64"):
        write_safetensors(tmp_path / "t.safetensors", layout, lambda n: torch.zeros(2, 2, dtype=torch.float64))


def _checkpoint(root, step, files=None, meta=None):
    """A finished checkpoint of `step` under `root` holding `files` (name -> bytes) and meta.json."""
    tmp = root / f".tmp_{step_dir_name(step)}"
    tmp.mkdir(parents=True)
    files = {META: json.dumps(meta or {"step": step}).encode(), **(files or {})}
    entries = {name: write_bytes_synced(tmp / name, data) for name, data in files.items()}
    finalize(tmp, root / step_dir_name(step), entries, step)
    return root / step_dir_name(step)


@pytest.mark.parametrize("write", [lambda path: write_tensors_synced(path, MIXED, {}),
                                   lambda path: write_bytes_synced(path, b"meta" * 10)], ids=["tensors", "bytes"])
def test_a_full_disk_names_the_file_it_could_not_write(write):
    """ENOSPC comes from write() or flush(), whose OSError names no file: the user of a run.dir,
    a cache and a /tmp on different disks could not tell which one is full. /dev/full is one."""
    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device: '/dev/full'$"):
        write(Path("/dev/full"))


def test_finalize_writes_the_manifest_last_and_replaces_an_earlier_save_of_the_step_whole(tmp_path):
    first = _checkpoint(tmp_path, 7, {"b.bin": b"old", "gone.bin": b"only in the first"})
    second = _checkpoint(tmp_path, 7, {"b.bin": b"new", "a.bin": b"a"})
    assert first == second and sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(7)]
    manifest = read_manifest(second)
    assert manifest["step"] == 7 and manifest["version"] == FORMAT_VERSION
    assert list(manifest["files"]) == ["a.bin", "b.bin", META]  # sorted, the manifest itself not listed
    assert not (second / "gone.bin").exists() and (second / "b.bin").read_bytes() == b"new"
    assert verify(second) is None
    assert read_meta(second) == {"step": 7}
    with pytest.raises(CheckpointError, match="no manifest.json"):
        read_meta(tmp_path)


def test_discovery_orders_by_step_number_and_rotation_keeps_the_newest(tmp_path):
    for step in (100, 9, 10_000_000, 9_999_999):
        _checkpoint(tmp_path, step)
    (tmp_path / "step_12").mkdir()  # fewer than 7 digits: not a name meshlm writes
    (tmp_path / "step_0000050").write_text("a file, not a checkpoint")
    (tmp_path / ".tmp_step_0000200").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000009", "step_0000100", "step_9999999",
                                                            "step_10000000"]  # by number, not by name
    assert list_checkpoints(tmp_path / "absent") == []
    assert rotate(tmp_path, 0) == [] and len(list_checkpoints(tmp_path)) == 4  # keep <= 0: keep all
    removed = rotate(tmp_path, 2)
    assert [p.name for p in removed] == ["step_0000009", "step_0000100"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_9999999", "step_10000000"]
    clear_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000050", "step_10000000", "step_12", "step_9999999"]
    clear_stale_temporaries(tmp_path / "absent")  # no directory yet: nothing to do


@pytest.mark.parametrize("damage,reason", [
    (lambda d: (d / "x.bin").unlink(), "x.bin: missing"),
    (lambda d: (d / "x.bin").write_bytes(b"012345678"), "x.bin: 9 bytes, the manifest says 10"),
    (lambda d: (d / "x.bin").write_bytes(b"0123456780"), "x.bin: contents do not match the manifest's checksum"),
    (lambda d: (d / MANIFEST).unlink(), "no manifest.json (not a checkpoint, or its save never finished)"),
    (lambda d: (d / MANIFEST).write_text("{"), "manifest.json: unreadable"),
    (lambda d: (d / MANIFEST).write_text('{"format": "other", "files": {}}'), "not a meshlm checkpoint manifest"),
    (lambda d: (d / MANIFEST).write_text('{"format": "a", "files": {}}'), "not a meshlm checkpoint manifest"),
    (lambda d: (d / MANIFEST).write_text('{"format": "meshlm-checkpoint", "files": []}'),
     "not a meshlm checkpoint manifest"),
    (lambda d: (d / MANIFEST).write_text('{"format": "meshlm-checkpoint", "version": 99, "files": {}}'),
     "checkpoint format version 99 (this meshlm reads 1)"),
    (lambda d: (d / MANIFEST).write_text('{"format": "meshlm-checkpoint", "version": 1, "files": {}}'),
     "manifest.json: lists no meta.json"),
])
def test_verify_names_what_is_wrong_in_one_line(tmp_path, damage, reason):
    path = _checkpoint(tmp_path, 3, {"x.bin": b"0123456789"})
    damage(path)
    problem = verify(path)
    assert problem is not None and reason in problem and "\n" not in problem


def test_verify_of_a_file_not_a_directory(tmp_path):
    (tmp_path / "step_0000001").write_text("")
    assert verify(tmp_path / "step_0000001") == f"{tmp_path / 'step_0000001'}: not a directory"


def test_each_share_hashes_its_own_files_and_the_shares_cover_all(tmp_path):
    names = [f"f{i}.bin" for i in range(5)]
    path = _checkpoint(tmp_path, 1, {name: name.encode() for name in names})
    listed = sorted([*names, META])
    for bad in listed:
        (path / bad).write_bytes(b"?" * len((path / bad).read_bytes()))  # same size, other bytes
        found = [i for i in range(3) if verify(path, (i, 3)) is not None]
        assert found == [listed.index(bad) % 3], bad  # exactly one share sees it
        assert bad in verify(path)
        _checkpoint(tmp_path, 1, {name: name.encode() for name in names})  # repaired


def _pieced(tmp_path, twice: bool = False):
    """A checkpoint of a 6 x 4 tensor `w` split over two rank files into three rectangles, and a
    1-D `b` in one; rank 1 also holds an RNG state. `twice`: both ranks wrote the top-left piece
    (as two replicas would if both thought they owned it)."""
    w = torch.arange(24, dtype=torch.float32).view(6, 4)
    b = torch.arange(4, dtype=torch.float32) - 10
    pieces = {0: [("master/w/0,0", w[:4, :2], (0, 0)), ("master/b/0,0", b.view(1, 4), (0, 0))],
              1: [("master/w/0,2", w[:4, 2:], (0, 2)), ("master/w/4,0", w[4:], (4, 0)),
                  *([("master/w/0,0", w[:4, :2], (0, 0))] if twice else [])]}
    tmp = tmp_path / ".tmp_step_0000001"
    tmp.mkdir()
    entries = {META: write_bytes_synced(tmp / META, json.dumps({"shapes": {"w": [6, 4], "b": [4]}}).encode())}
    for rank, parts in pieces.items():
        tensors = {key: t.contiguous() for key, t, _ in parts}
        if rank == 1:
            tensors["rng/cpu"] = torch.arange(3, dtype=torch.uint8)
        index = [[key, "master", key.split("/")[1], r, c, t.shape[0], t.shape[1]] for key, t, (r, c) in parts]
        entries[rank_file(rank)] = write_tensors_synced(tmp / rank_file(rank), tensors, {"pieces": json.dumps(index)})
    finalize(tmp, tmp_path / "step_0000001", entries, 1)
    return CheckpointReader(tmp_path / "step_0000001"), w, b


@pytest.mark.parametrize("rect", [Rect(0, 0, 6, 4), Rect(3, 1, 2, 3), Rect(1, 1, 1, 1), Rect(5, 3, 1, 1),
                                  Rect(1, 2, 2, 1),
                                  Rect(0, 2, 6, 2), Rect(3, 0, 3, 4)])
def test_any_rectangle_is_assembled_from_the_pieces_that_hold_it(tmp_path, rect):
    reader, w, _ = _pieced(tmp_path)
    out = torch.full((rect.rows, rect.cols), float("nan"), dtype=torch.float64)
    reader.read("master", "w", rect, out)
    assert torch.equal(out, w[rect.row: rect.row + rect.rows, rect.col: rect.col + rect.cols].double())


def test_the_reader_refuses_what_was_not_stored_and_serves_whole_and_per_rank_tensors(tmp_path):
    reader, w, b = _pieced(tmp_path)
    assert torch.equal(reader.full("master", "w"), w) and torch.equal(reader.full("master", "b"), b)
    assert reader.has("master", "w") and not reader.has("exp_avg", "w") and not reader.has("master", "v")
    with pytest.raises(CheckpointError, match=r"exp_avg of w rows 0\.\.6 cols 0\.\.4: 0 of 24 elements stored"):
        reader.full("exp_avg", "w")
    with pytest.raises(CheckpointError, match=r"rows 5\.\.7 cols 0\.\.4: 4 of 8 elements stored"):
        reader.read("master", "w", Rect(5, 0, 2, 4), torch.empty(2, 4))  # one row beyond the tensor
    assert torch.equal(reader.rank_tensor(1, "rng/cpu"), torch.arange(3, dtype=torch.uint8))
    assert reader.rank_tensor(0, "rng/cpu") is None and reader.rank_tensor(2, "rng/cpu") is None


def test_elements_stored_twice_are_refused_too(tmp_path):
    reader, *_ = _pieced(tmp_path, twice=True)
    with pytest.raises(CheckpointError, match=r"master of w rows 0\.\.6 cols 0\.\.4: 32 of 24 elements stored"):
        reader.full("master", "w")
    reader.read("master", "w", Rect(4, 0, 2, 4), torch.empty(2, 4))  # rows no replica wrote twice: fine


def test_a_damaged_rank_file_header_is_one_checkpoint_error(tmp_path):
    reader, *_ = _pieced(tmp_path)
    (reader.path / rank_file(1)).write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="unreadable"):
        CheckpointReader(reader.path)


def test_the_newest_good_checkpoint_is_found_warning_about_each_newer_one(tmp_path):
    warnings = []
    assert newest_good(tmp_path, verify, warnings.append) is None and not warnings
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step, {"x.bin": b"ok"})
    (tmp_path / "step_0000003" / "x.bin").write_bytes(b"no")
    (tmp_path / "step_0000004").mkdir()
    assert newest_good(tmp_path, verify, warnings.append).name == "step_0000002"
    assert [w.split(":")[0] for w in warnings] == ["skipping checkpoint step_0000004",
                                                   "skipping checkpoint step_0000003"]
    for step in (1, 2):
        (tmp_path / step_dir_name(step) / "x.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*: .*step_0000004.*no manifest.json"):
        newest_good(tmp_path, verify, warnings.append)
