"""Checkpoint integrity: a manifest written last, verified on resume; corrupt ones are moved aside, never deleted."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil

import pytest
import torch
from eagle3 import checkpoint as ckpt


def _save(run_dir, step, keep=5, weight=1.0):
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, weight)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # optimizer state to save
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tmp = ckpt.tmp_dir_for(run_dir, step)
    tmp.mkdir(parents=True)
    ckpt.write_rng(tmp, 0)
    state = ckpt.TrainerState(
        step=step, epoch=0, step_in_epoch=step, samples_seen=step, world_size=1, max_seq_len=128, seed=0
    )
    ckpt.write_main(tmp, ckpt.trainable_state(model), opt.state_dict(), sched, state, {"seed": 0})
    return ckpt.finalize(run_dir, step, keep)


def _truncate(path, keep_bytes=100):
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])


def _zero_fill(path):
    path.write_bytes(b"\0" * path.stat().st_size)


def test_marker_is_a_manifest_of_every_file(tmp_path):
    path = _save(tmp_path, 7)
    manifest = json.loads((path / ckpt.MARKER).read_text())
    assert manifest["step"] == 7 and manifest["time"] > 0
    names = sorted(p.name for p in path.iterdir() if p.name != ckpt.MARKER)
    assert sorted(manifest["files"]) == names
    for name, entry in manifest["files"].items():
        size, digest = ckpt.file_digest(path / name)
        assert entry == {"size": size, "sha256": digest}
    assert ckpt.verify(path) is None
    assert ckpt.checkpoint_time(path) == manifest["time"]


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: _truncate(p / "model.safetensors"), ["model.safetensors has 100 bytes", "truncated"]),
        (lambda p: _zero_fill(p / "model.safetensors"), ["model.safetensors", "sha256"]),
        (lambda p: _zero_fill(p / "optimizer.pt"), ["optimizer.pt", "sha256"]),
        (lambda p: (p / "trainer_state.json").unlink(), ["trainer_state.json is missing"]),
        (lambda p: (p / ckpt.MARKER).write_bytes(b"\0" * 64), ["bad COMPLETE marker"]),
        (lambda p: (p / ckpt.MARKER).write_text(""), ["bad COMPLETE marker"]),
        (lambda p: (p / ckpt.MARKER).write_text('{"step": 3, "files": {}}'), ["marker says step 3"]),
        (lambda p: (p / ckpt.MARKER).write_text('{"step": 7, "files": {}}'), ["manifest lacks model.safetensors"]),
    ],
    ids=[
        "truncated",
        "zeroed-weights",
        "zeroed-optimizer",
        "missing-file",
        "zeroed-marker",
        "empty-marker",
        "wrong-step",
        "empty-manifest",
    ],
)
def test_verify_names_what_is_wrong(tmp_path, damage, words):
    path = _save(tmp_path, 7)
    damage(path)
    reason = ckpt.verify(path)
    assert reason is not None
    for word in words:
        assert word in reason, reason


def test_old_markers_are_checked_by_loading(tmp_path):
    path = _save(tmp_path, 4)
    (path / ckpt.MARKER).write_text("4\n")  # a checkpoint written before manifests
    assert ckpt.verify(path) is None
    _truncate(path / "model.safetensors", 40)
    assert "does not load" in ckpt.verify(path)


def test_corrupt_newest_is_moved_aside_with_one_warning_each_and_the_previous_is_used(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, weight=step)
    root = ckpt.checkpoints_dir(tmp_path)
    _truncate(root / "step_00000006" / "model.safetensors")
    _zero_fill(root / "step_00000004" / "optimizer.pt")
    warnings = []
    found, skipped = ckpt.choose_resume(tmp_path, warn=warnings.append)
    assert found == root / "step_00000002"
    assert ckpt.load_model_state(found)["weight"].round().eq(2).all()
    assert [s["name"] for s in skipped] == ["step_00000006", "step_00000004"]
    assert [s["moved_to"] for s in skipped] == ["step_00000006.corrupt", "step_00000004.corrupt"]
    assert len(warnings) == 2
    assert str(root / "step_00000006") in warnings[0] and "truncated" in warnings[0]
    assert "moved aside" in warnings[0] and "step_00000006.corrupt" in warnings[0]
    assert "optimizer.pt" in warnings[1] and "sha256" in warnings[1]
    # Kept for inspection, with their content, and out of the way of resume, pruning and stale cleanup.
    assert (root / "step_00000006.corrupt" / "model.safetensors").stat().st_size == 100
    assert [s for s, _ in ckpt.list_valid(tmp_path)] == [2]
    assert ckpt.remove_stale(tmp_path) == []
    _save(tmp_path, 8, keep=1)
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000004.corrupt",
        "step_00000006.corrupt",
        "step_00000008",
    ]


def test_all_corrupt_gives_none_and_keeps_them_all(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step)
        _zero_fill(ckpt.checkpoints_dir(tmp_path) / ckpt.step_dir_name(step) / "model.safetensors")
    warnings = []
    found, skipped = ckpt.choose_resume(tmp_path, warn=warnings.append)
    assert found is None and len(skipped) == 2 and len(warnings) == 2
    assert sorted(p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()) == [
        "step_00000001.corrupt",
        "step_00000002.corrupt",
    ]


def test_a_second_corrupt_copy_of_a_step_gets_its_own_name(tmp_path):
    path = _save(tmp_path, 3)
    first = ckpt.quarantine(path)
    path = _save(tmp_path, 3)
    second = ckpt.quarantine(path)
    assert (first.name, second.name) == ("step_00000003.corrupt", "step_00000003.corrupt.1")


def test_unrenamable_corrupt_checkpoint_is_left_and_said_so(tmp_path, monkeypatch):
    path = _save(tmp_path, 5)
    _zero_fill(path / "model.safetensors")

    def refuse(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(ckpt.os, "rename", refuse)
    warnings = []
    found, skipped = ckpt.choose_resume(tmp_path, warn=warnings.append)
    assert found is None and skipped[0]["moved_to"] is None
    assert "left in place" in warnings[0] and "Read-only" in warnings[0]
    assert path.is_dir()


# ------------------------------------------------------------------------------------------ a full disk
def test_disk_full_is_recognised_through_torch_save_and_safetensors(tmp_path):
    class FullFile(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(Exception) as info:
        torch.save({"a": torch.zeros(1000)}, FullFile())
    assert ckpt.is_disk_full(info.value)  # torch keeps the OSError as the context of its RuntimeError
    assert ckpt.is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert ckpt.is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not ckpt.is_disk_full(OSError(errno.EIO, "Input/output error"))


def test_full_disk_while_publishing_best_keeps_the_old_best(tmp_path, monkeypatch):
    first = _save(tmp_path, 1, weight=1)
    ckpt.save_best(tmp_path, first)
    second = _save(tmp_path, 2, weight=2)

    def full(src, dst, *args, **kwargs):
        os.makedirs(dst)  # a partial copy, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.shutil, "copytree", full)
    with pytest.raises(OSError) as info:
        ckpt.save_best(tmp_path, second)
    assert ckpt.is_disk_full(info.value)
    root = ckpt.checkpoints_dir(tmp_path)
    assert not (root / ".tmp_best").exists()
    assert ckpt.load_model_state(root / ckpt.BEST)["weight"].round().eq(1).all()


def test_best_is_a_copy_that_damage_to_its_step_does_not_reach(tmp_path):
    step = _save(tmp_path, 3, weight=3)
    best = ckpt.save_best(tmp_path, step)
    for name in ckpt.REQUIRED_FILES:
        assert os.stat(best / name).st_ino != os.stat(step / name).st_ino  # not a hard link
    _zero_fill(step / "model.safetensors")  # the step's weights damaged in place
    assert ckpt.verify(step) is not None
    assert ckpt.verify(best) is None
    assert ckpt.load_model_state(best)["weight"].round().eq(3).all()


def test_full_disk_in_the_middle_of_a_save_leaves_the_previous_checkpoints(tmp_path, monkeypatch):
    _save(tmp_path, 2, weight=2)
    real = ckpt.save_file

    def half_then_full(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        _truncate(ckpt.Path(filename), 50)  # a partial file, as the disk ran out
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(ckpt, "save_file", half_then_full)
    with pytest.raises(OSError) as info:
        _save(tmp_path, 4)
    assert ckpt.is_disk_full(info.value)
    # The trainer removes the temporary directory (checkpointer.Checkpointer._agree); nothing else changed.
    shutil.rmtree(ckpt.tmp_dir_for(tmp_path, 4))
    assert [s for s, _ in ckpt.list_valid(tmp_path)] == [2]
    assert ckpt.verify(ckpt.newest_valid(tmp_path)) is None
