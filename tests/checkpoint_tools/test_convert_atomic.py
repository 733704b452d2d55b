"""Conversions write their destination whole or not at all, and never into a directory they do not own.

A failure injected at every write step of `hf2engine` (each shard, the source config, each tokenizer
file, the index, each rename) leaves either no checkpoint, the previous one, or the new one complete;
a process killed just before the index is written leaves no checkpoint; a non-empty destination is
refused (exit 2, untouched) unless `--force`, and `--force` replaces only a previous checkpoint.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import write_tiny_hf

from spd_engine.checkpoint_tools import hf, output_dir, shard
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.tools.cli import main


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes (what "untouched" compares)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def tiny_hf(tmp_path: Path) -> Path:
    write_tiny_hf(tmp_path / "hf", tiny_config("llama"))
    (tmp_path / "hf" / "tokenizer.json").write_text('{"stand-in": true}')
    return tmp_path / "hf"


def complete(path: Path) -> bool:
    """A checkpoint that reads, whose every tensor verifies, and that carries its tokenizer files."""
    index = ckpt.read_index(path)
    for r in range(index.tp):
        ckpt.load_stage_state(path, range(0, index.cfg.num_layers), True, True, tp_rank=r)
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


def test_non_empty_destination_refused_untouched(tiny_hf: Path, tmp_path: Path, capsys) -> None:
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "stage-00-of-01.tp-00-of-01.safetensors").write_bytes(b"a file named like a shard")
    (mine / "sub" / "index.json").write_text("{}")
    before = snapshot(mine)
    for extra in ([], ["--force"]):
        assert main(["convert", "hf2engine", str(tiny_hf), str(mine), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert ("--force replaces only a previous checkpoint" if extra else "is not empty") in err
        assert snapshot(mine) == before
    # a file where the directory should be, and the source itself, are refused the same way
    assert main(["convert", "hf2engine", str(tiny_hf), str(mine / "notes.txt")]) == 2
    assert main(["convert", "engine2hf", str(tiny_hf), str(tiny_hf), "--force"]) == 2
    assert "holds the source" in capsys.readouterr().err
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no temporary left


def test_force_replaces_only_a_previous_checkpoint(tiny_hf: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "e"
    assert main(["convert", "hf2engine", str(tiny_hf), str(out), "--stages", "3"]) == 0
    assert main(["convert", "hf2engine", str(tiny_hf), str(out), "--stages", "2"]) == 2  # no --force
    assert ckpt.read_index(out).n == 3
    assert main(["convert", "hf2engine", str(tiny_hf), str(out), "--stages", "2", "--force"]) == 0
    assert ckpt.read_index(out).n == 2 and complete(out)
    assert len(list(out.glob("stage-*"))) == 2  # the 3-stage shards went with the old checkpoint
    assert main(["convert", "engine2hf", str(out), str(tmp_path / "h")]) == 0
    assert main(["convert", "engine2hf", str(out), str(tmp_path / "h"), "--force"]) == 0  # a previous HF dir
    assert main(["convert", "export-megatron", str(out), str(tmp_path / "m"), "--release-layout"]) == 0
    assert main(["convert", "export-megatron", str(out), str(tmp_path / "m"), "--force"]) == 0
    assert output_dir.previous_checkpoint_kind(tmp_path / "m") == "Megatron checkpoint"
    assert main(["convert", "import-megatron", str(tmp_path / "m"), str(out), "--stages", "3"]) == 2
    assert ckpt.read_index(out).n == 2
    assert main(["convert", "import-megatron", str(tmp_path / "m"), str(out), "--stages", "3", "--force"]) == 0
    assert ckpt.read_index(out).n == 3 and complete(out)  # with the tokenizer the export carried
    # one file of anything else in a previous checkpoint and it is no longer ours to delete
    (out / "results.csv").write_text("1,2\n")
    assert main(["convert", "hf2engine", str(tiny_hf), str(out), "--force"]) == 2
    assert "not one (it holds " in capsys.readouterr().err and (out / "results.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e", "h", "hf", "m"]
    site = tmp_path / "site"  # named like a checkpoint's files, but not one
    site.mkdir()
    (site / "index.json").write_text('{"pages": []}')
    assert main(["convert", "hf2engine", str(tiny_hf), str(site), "--force"]) == 2
    assert (site / "index.json").read_text() == '{"pages": []}'


def test_a_full_disk_is_one_line_and_writes_nothing(tiny_hf: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    import errno

    def full(tensors, file):
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(ckpt, "save_safetensors", full)
    assert main(["convert", "hf2engine", str(tiny_hf), str(tmp_path / "e")]) == 2
    assert "no space left to write" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_empty_and_missing_destinations_are_written(tiny_hf: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    shard.hf2mcore(tiny_hf, tmp_path / "empty")
    shard.hf2mcore(tiny_hf, tmp_path / "a" / "b" / "new")
    assert complete(tmp_path / "empty") and complete(tmp_path / "a" / "b" / "new")


class Injected(Exception):
    """The failure a test injects at one write step."""


def _count_steps(monkeypatch, fail_at: int | None) -> list[str]:
    """Wrap every call that writes or renames part of a checkpoint; raise `Injected` at step `fail_at`."""
    steps: list[str] = []

    def wrap(owner, name: str) -> None:
        real = getattr(owner, name)

        def step(*args, **kwargs):
            target = args[0] if name == "write_text" else args[-1]  # the file written or renamed to
            steps.append(f"{name}({Path(target).name})")
            if len(steps) - 1 == fail_at:
                raise Injected(steps[-1])
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, step)

    wrap(ckpt, "save_safetensors")
    wrap(hf.shutil, "copyfile")
    wrap(Path, "write_text")
    wrap(os, "replace")
    wrap(os, "rename")
    return steps


@pytest.mark.parametrize("previous", [False, True], ids=["new", "replacing"])
def test_a_failure_at_any_write_step_leaves_no_checkpoint_or_a_complete_one(tiny_hf: Path, tmp_path: Path,
                                                                            monkeypatch, previous: bool) -> None:
    out = tmp_path / "e"
    if previous:
        shard.hf2mcore(tiny_hf, out, pp=3)
        old = snapshot(out)
        shutil.copytree(out, tmp_path / "probe")
    with monkeypatch.context() as m:  # the steps of the same conversion
        steps = _count_steps(m, None)
        shard.hf2mcore(tiny_hf, tmp_path / "probe", pp=2, tp=2, force=previous)
    shutil.rmtree(tmp_path / "probe")
    # 4 shards, the source config, 2 tokenizer files, the index, the rename(s)
    assert len(steps) >= 10 and steps[-1].startswith("rename"), steps
    for k in range(len(steps)):
        for killed in (False, True):  # an exception cleans up; a kill (no cleanup runs) leaves its temporary
            with monkeypatch.context() as m:
                _count_steps(m, k)
                if killed:
                    m.setattr(output_dir.shutil, "rmtree", lambda *a, **kw: None)
                with pytest.raises(Injected):
                    shard.hf2mcore(tiny_hf, out, pp=2, tp=2, force=previous)
            if out.exists():
                assert snapshot(out) == old if previous else False, f"failed at {steps[k]}: {out} was written"
            leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("hf", "e")]
            assert all(n.startswith((".e.partial-", ".e.replaced-")) for n in leftovers), leftovers
            assert killed or not leftovers, (steps[k], leftovers)
            for name in leftovers:
                shutil.rmtree(tmp_path / name)
            if previous and not out.exists():  # killed between moving the old one aside and the rename
                assert killed and "rename" in steps[k]
                shard.hf2mcore(tiny_hf, out, pp=3)
    shard.hf2mcore(tiny_hf, out, pp=2, tp=2, force=previous)
    assert complete(out) and ckpt.read_index(out).tp == 2


KILL_BEFORE_INDEX = """
import os, signal, sys
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.tools.cli import main

def killed(index):  # the moment a non-atomic conversion left shards and index without the tokenizer
    os.kill(os.getpid(), signal.SIGKILL)

ckpt.write_index = killed
sys.exit(main(["convert", "hf2engine", sys.argv[1], sys.argv[2]]))
"""


def test_a_killed_conversion_process_leaves_no_checkpoint(tiny_hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "e"
    proc = subprocess.Popen([sys.executable, "-c", KILL_BEFORE_INDEX, str(tiny_hf), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, stderr
    assert not out.exists()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".e.partial-")]
    assert len(partial) == 1 and any(partial[0].glob("stage-*.safetensors"))  # it was killed mid-conversion
    assert f"-{proc.pid}-" in partial[0].name
    (tmp_path / f".e.partial-elsewhere-{proc.pid}-x").mkdir()  # another host's: not ours to judge
    assert main(["convert", "hf2engine", str(tiny_hf), str(out)]) == 0 and complete(out)
    assert not partial[0].exists()  # the next conversion into `e` swept the dead process's temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".e.partial-elsewhere-{proc.pid}-x", "e", "hf"]
