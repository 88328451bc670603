"""io/atomic: outputs others can read (umask, not mkstemp's 0600), durable renames, clean
replacement of whatever was there."""

from __future__ import annotations

import os
import stat

import pytest

from eagle3kit.io import atomic


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_outputs_honour_the_umask(tmp_path, umask_022):
    with atomic.atomic_path(tmp_path / "vocab.safetensors") as tmp:
        tmp.write_bytes(b"x")
    assert mode(tmp_path / "vocab.safetensors") == 0o644
    with atomic.atomic_dir(tmp_path / "export") as tmp:
        (tmp / "config.json").write_text("{}")
    assert mode(tmp_path / "export") == 0o755
    assert mode(tmp_path / "export" / "config.json") == 0o644
    os.umask(0o077)  # a user who wants private files gets them
    with atomic.atomic_path(tmp_path / "private") as tmp:
        tmp.write_bytes(b"x")
    assert mode(tmp_path / "private") == 0o600


@pytest.mark.parametrize("existing", ["file", "dir"])
def test_force_replaces_a_file_or_a_directory_and_leaves_nothing_behind(tmp_path, existing):
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("old")
    else:
        out.mkdir()
        (out / "old.bin").write_text("old")
    with pytest.raises(FileExistsError):
        with atomic.atomic_dir(out):
            pass
    with atomic.atomic_dir(out, force=True) as tmp:
        (tmp / "new.bin").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .out.old, no .tmp
    assert [p.name for p in out.iterdir()] == ["new.bin"]


def test_renames_are_fsynced_with_their_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                  real_fsync(fd)))
    with atomic.atomic_path(tmp_path / "a.json") as tmp:
        tmp.write_text("{}")
    assert synced[0] == str(tmp) and synced[-1] == str(tmp_path)  # the data, then the rename
    synced.clear()
    with atomic.atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "state.safetensors").write_bytes(b"x")
    assert str(tmp / "state.safetensors") in synced and synced[-1] == str(tmp_path)
