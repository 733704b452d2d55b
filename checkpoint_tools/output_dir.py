"""A converter's output directory: guarded, and written whole or not at all.

`atomic_output(dst)` yields a fresh temporary sibling of `dst` (`.NAME.partial-*`); the converter
writes everything there, its completion marker last, and the directory is renamed into place only
when the converter returns. An exception removes the temporary; a killed process leaves it beside
`dst` under its hidden name, never a partial checkpoint under `dst`.

A killed conversion's temporary is deleted by the next conversion into the same destination on the
same host (its name carries the host and the process id, and that process is gone).

The destination must not exist or be empty. A non-empty one is refused unless `force`, and `force`
replaces only a previous checkpoint: a directory that holds nothing but the files an engine
checkpoint, an HF directory or a Megatron torch_dist export consists of (never `/etc`, a home
directory or a folder of the user's own files). The old checkpoint is moved aside before the new one
takes its name and deleted after, so a kill in between leaves no checkpoint, not a mixed one.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from spd_engine.checkpoint_tools.hf import TOKENIZER_FILES

# What each checkpoint kind writes: (marker file and the JSON key that tells it is that kind's, names
# allowed, allowed sub-directories).
_TOKENIZER = "|".join(re.escape(f) for f in TOKENIZER_FILES)
_MEGATRON = r"metadata\.json|common\.pt|\.metadata|__\d+_\d+\.distcp|latest_checkpointed_iteration\.txt"
KINDS: dict[str, tuple[tuple[str, str], re.Pattern[str], frozenset[str]]] = {
    "engine checkpoint": (("index.json", "content_hash"), re.compile(
        rf"index\.json|hf_config\.json|stage-\d+-of-\d+\.tp-\d+-of-\d+\.safetensors|{_TOKENIZER}"), frozenset()),
    "HF directory": (("config.json", "model_type"), re.compile(
        rf"config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|"
        rf"\.spd-fetch-complete\.json|{_TOKENIZER}"), frozenset()),
    "Megatron checkpoint": (("metadata.json", "sharded_backend"), re.compile(rf"{_MEGATRON}|{_TOKENIZER}"),
                            frozenset({"release", "tokenizer"})),
}


def _only_allowed(path: Path, allowed: re.Pattern[str], subdirs: frozenset[str]) -> list[str]:
    """Entries of `path` (and of its allowed sub-directories) that the checkpoint kind never writes."""
    odd = []
    for entry in sorted(path.iterdir()):
        if entry.is_symlink():
            odd.append(entry.name)
        elif entry.is_dir() and entry.name in subdirs:
            odd += [f"{entry.name}/{n}" for n in _only_allowed(entry, allowed, frozenset())]
        elif not (entry.is_file() and allowed.fullmatch(entry.name)):
            odd.append(entry.name)
    return odd


def previous_checkpoint_kind(path: Path) -> str | None:
    """The kind of checkpoint `path` holds when it holds only such a checkpoint's files, else None."""
    for kind, ((marker, key), allowed, subdirs) in KINDS.items():
        top = path / "release" if kind == "Megatron checkpoint" and (path / "release").is_dir() else path
        if _has_key(top / marker, key) and not _only_allowed(path, allowed, subdirs):
            return kind
    return None


def _has_key(file: Path, key: str) -> bool:
    """`file` is a JSON object with `key` (an index.json of a web page is not an engine checkpoint's)."""
    try:
        raw = json.loads(file.read_text()) if file.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and key in raw


def check_destination(dst: Path, force: bool, sources: tuple[Path, ...] = ()) -> None:
    """ValueError unless a converter may write `dst`: absent, empty, or (with `force`) a previous checkpoint
    that does not hold one of `sources`."""
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise ValueError(f"{dst} exists and is not a directory; choose a new directory")
    real = dst.resolve()
    for src in sources:
        src = Path(src).resolve()
        if src == real or real in src.parents:
            raise ValueError(f"{dst} holds the source {src}; write the conversion into another directory")
    if not dst.exists() or not any(dst.iterdir()):
        return
    if not force:
        raise ValueError(f"{dst} is not empty; choose a new directory, or pass --force to replace a previous "
                         f"checkpoint there")
    if previous_checkpoint_kind(dst) is None:
        entries = sorted(p.name for p in dst.iterdir())
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ValueError(f"--force replaces only a previous checkpoint, and {dst} is not one (it holds {shown})")


def _normal_mode(path: Path) -> None:
    """The permissions a plain mkdir would give (mkdtemp makes the directory private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def replace_dir(tmp: Path, dst: Path) -> None:
    """Rename the finished `tmp` to `dst`, moving a previous checkpoint there aside first."""
    if not (dst.is_dir() and any(dst.iterdir())):
        os.rename(tmp, dst)  # replaces an empty directory
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.replaced-", dir=dst.parent))
    try:
        os.rename(dst, old / dst.name)
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(old / dst.name, dst)  # the previous checkpoint back under its name
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _partial_prefix(dst: Path, pid: int | None) -> str:
    """`.NAME.partial-HOST-PID-` (without PID and its dash when None): the temporary's name before mkdtemp's part."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())
    return f".{dst.name}.partial-{host}-" + ("" if pid is None else f"{pid}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_partials(dst: Path) -> list[Path]:
    """Delete the temporaries that killed conversions into `dst` on this host left; returns them."""
    prefix = _partial_prefix(dst, None)
    swept = []
    for path in dst.parent.glob(glob.escape(prefix) + "*") if dst.parent.is_dir() else ():
        m = re.fullmatch(r"(\d+)-\w+", path.name[len(prefix):])
        if m and path.is_dir() and not path.is_symlink() and int(m.group(1)) != os.getpid() \
                and not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
    return swept


# Free bytes under which a failed write is taken for a full disk (see `space_reported`).
FULL_BYTES = 1 << 20


def no_space(err: BaseException) -> bool:
    """A write that failed for want of space: OSError ENOSPC or EDQUOT, or safetensors' error wrapping one
    (it raises its own type, naming the OS error only in its message)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    found = re.search(r"\(os error (\d+)\)", str(err)) if isinstance(err, SafetensorError) else None
    return found is not None and int(found.group(1)) in (errno.ENOSPC, errno.EDQUOT)


def is_full(path: Path) -> bool:
    """Less than FULL_BYTES left to an unprivileged writer on `path`'s filesystem."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BYTES


@contextmanager
def space_reported(dst: Path) -> Iterator[None]:
    """A full disk while writing `dst` (into a temporary the caller deletes): one line, not a traceback.

    Some writers lose the OS error: torch.save fails with "unexpected pos" and torch.distributed.checkpoint
    wraps that in its own exception. Any failure but a user error (ValueError) while the filesystem
    has (almost) nothing left is therefore reported as the full disk it is; an interrupt never is."""
    try:
        yield
    except BaseException as err:  # torch's CheckpointException is a BaseException; re-raised unless the disk is full
        if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit, ValueError)) or not (
                no_space(err) or is_full(Path(dst).parent)):
            raise
        raise ValueError(f"no space left to write {dst} ({os.strerror(errno.ENOSPC)}); nothing was written "
                         f"there") from None


@contextmanager
def atomic_output(dst: str | Path, *, force: bool = False, sources: tuple[Path, ...] = ()) -> Iterator[Path]:
    """A temporary sibling of `dst` to write into, renamed to `dst` when the block ends without an error."""
    dst = Path(dst).expanduser()
    check_destination(dst, force, sources)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        sweep_partials(dst)
        tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(dst, os.getpid()), dir=dst.parent))
    except OSError as err:  # a read-only or missing place: the user's to fix, one line
        raise ValueError(f"cannot write {dst}: {err.strerror} ({err.filename or dst.parent})") from None
    try:
        with space_reported(dst):
            yield tmp
            _normal_mode(tmp)
            check_destination(dst, force, sources)  # something may have appeared there meanwhile
            replace_dir(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
