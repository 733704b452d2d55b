"""A full disk while converting or fetching: one line and exit 2, and nothing left under the destination.

The writers fail as they do on a full filesystem: safetensors with its own error type that names
the OS error only in its message, torch.distributed.checkpoint with a BaseException around torch's
"unexpected pos" that has lost the errno (reported when the filesystem is then full), a plain write
with OSError ENOSPC. Where this host lets root mount a private tmpfs (`unshare -m`), a conversion
into a tmpfs too small for it is run for real.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import types
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from ckpt_helpers import write_tiny_hf
from safetensors import SafetensorError

from spd_engine.checkpoint_tools import fetch, output_dir
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.tools.cli import main

# What safetensors raises when the disk fills under save_file (seen on a full tmpfs)
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture
def tiny_hf(tmp_path: Path) -> Path:
    write_tiny_hf(tmp_path / "hf", tiny_config("llama"))
    (tmp_path / "hf" / "tokenizer.json").write_text('{"stand-in": true}')
    return tmp_path / "hf"


def one_line(capsys) -> str:
    """The one error line, last on stderr (after any progress lines), and no traceback."""
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert "Traceback" not in err and [ln for ln in lines if "error" in ln] == lines[-1:], err
    return lines[-1]


def test_safetensors_running_out_of_space_is_one_line(tiny_hf: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    def full(tensors, file, metadata=None):
        Path(file).write_bytes(b"half a shard")
        raise SafetensorError(FULL)

    monkeypatch.setattr(ckpt, "save_file", full)
    assert main(["convert", "hf2engine", str(tiny_hf), str(tmp_path / "e")]) == 2
    assert "no space left to write" in one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no checkpoint, no temporary


def test_a_writer_that_lost_the_errno_is_reported_only_when_the_disk_is_full(tiny_hf: Path, tmp_path: Path,
                                                                           monkeypatch, capsys) -> None:
    class Wrapped(BaseException):  # as torch.distributed.checkpoint's CheckpointException is
        pass

    def lost(tensors, file, metadata=None):
        raise Wrapped("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt, "save_file", lost)
    monkeypatch.setattr(output_dir, "is_full", lambda path: True)
    assert main(["convert", "hf2engine", str(tiny_hf), str(tmp_path / "e")]) == 2
    assert "no space left to write" in one_line(capsys)
    monkeypatch.setattr(output_dir, "is_full", lambda path: False)  # space left: a fault, not the user's disk
    with pytest.raises(Wrapped):
        main(["convert", "hf2engine", str(tiny_hf), str(tmp_path / "e")])
    monkeypatch.setattr(output_dir, "is_full", lambda path: True)

    def interrupted(tensors, file, metadata=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "save_file", interrupted)  # an interrupt stays one, full disk or not
    assert main(["convert", "hf2engine", str(tiny_hf), str(tmp_path / "e")]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.pure
def test_no_space_reads_the_errno_and_safetensors_message() -> None:
    assert output_dir.no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert output_dir.no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert output_dir.no_space(SafetensorError(FULL))
    assert not output_dir.no_space(OSError(errno.EACCES, "Permission denied"))
    assert not output_dir.no_space(SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)"))
    assert not output_dir.no_space(RuntimeError("(os error 28)"))  # only safetensors words it so


@pytest.fixture
def pinned_blob(tmp_path: Path, monkeypatch) -> bytes:
    """A cache whose smollm2-135m wheel holds a small file pinned as the model's GGUF."""
    blob = os.urandom(3 << 20)
    monkeypatch.setitem(fetch.MODELS, "smollm2-135m", replace(
        fetch.MODELS["smollm2-135m"], size=len(blob), sha256=hashlib.sha256(blob).hexdigest()))
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "cache"))
    src = fetch.MODELS["smollm2-135m"]
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "cache" / "wheels" / src.wheel, "w") as zf:
        zf.writestr(src.member, blob)
    return blob


def test_fetch_extracting_onto_a_full_disk_is_one_line(pinned_blob: bytes, tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    def full_fdopen(fd: int, mode: str):
        os.close(fd)
        return open("/dev/full", mode)  # every write: ENOSPC from the kernel

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    monkeypatch.setattr(fetch, "os", types.SimpleNamespace(**{**vars(os), "fdopen": full_fdopen}))
    assert main(["fetch-model", "smollm2-135m"]) == 2
    err = one_line(capsys)
    assert "no space left to write" in err and "gguf" in err
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # no partial GGUF


def test_fetch_converting_onto_a_full_disk_is_one_line(pinned_blob: bytes, tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    def full(gguf: Path, out: Path) -> None:
        (Path(out) / "model.safetensors").write_bytes(b"half")
        raise SafetensorError(FULL)

    monkeypatch.setattr(fetch, "gguf_to_hf", full)
    assert main(["fetch-model", "smollm2-135m"]) == 2
    assert "no space left to write" in one_line(capsys)
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no model directory, no temporary
    assert (tmp_path / "cache" / "gguf" / fetch.MODELS["smollm2-135m"].file).read_bytes() == pinned_blob


def _private_tmpfs() -> bool:
    """Root may mount a tmpfs in a private mount namespace here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _private_tmpfs(), reason="needs root and unshare -m to mount a small tmpfs")
def test_a_conversion_into_a_too_small_tmpfs(tiny_hf: Path) -> None:
    """A real full filesystem: 64 KiB for a checkpoint several times larger."""
    size = sum(p.stat().st_size for p in tiny_hf.iterdir())
    assert size > 4 * 64 * 1024, size
    script = (f"mount -t tmpfs -o size=64k tmpfs /mnt && {sys.executable} -m spd_engine.tools.cli convert "
              f"hf2engine {tiny_hf} /mnt/out; echo rc=$?; ls -A /mnt")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["rc=2"], (proc.stdout, proc.stderr)  # exit 2 and /mnt left empty
    assert proc.stderr.strip().splitlines() == [
        "spd convert: error: no space left to write /mnt/out (No space left on device); nothing was written there"]
