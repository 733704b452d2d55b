"""Find a model id (`org/name`, optionally `@revision`) in the local Hugging Face cache; never download.

The layout is huggingface_hub's: `<hub cache>/models--org--name/refs/<branch>` holds a commit hash
and `snapshots/<commit>/` the files (links into `blobs/`). The hub cache is `$HF_HUB_CACHE`
(or the older `$HUGGINGFACE_HUB_CACHE`), else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
else `~/.cache/huggingface/hub`, as huggingface_hub decides it. A miss is a `ValueError` that says
where it looked.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

COMMIT = re.compile(r"^[0-9a-f]{40}$")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?$")


def hub_cache() -> Path:
    """The hub cache directory huggingface_hub would use."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def looks_like_repo_id(spec: str) -> bool:
    return bool(REPO_ID.match(spec)) and not spec.startswith((".", "/", "~"))


def find_snapshot(spec: str, cache: Path | None = None) -> Path:
    """The snapshot directory of `org/name[@revision]` (default revision: main)."""
    repo_id, _, revision = spec.partition("@")
    revision = revision or "main"
    cache = cache or hub_cache()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    where = f"looked in the Hugging Face cache {repo} (hub cache: $HF_HUB_CACHE, $HF_HOME/hub or " \
            f"~/.cache/huggingface/hub); nothing is downloaded, so fetch it there first, e.g. " \
            f"`huggingface-cli download {repo_id}`"
    if not repo.is_dir():
        raise ValueError(f"model {spec!r} not found: {where}")
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision if COMMIT.match(revision) else None
    snapshots = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    if commit is None and revision == "main" and len(snapshots) == 1:
        commit = snapshots[0]  # a cache filled without refs (e.g. copied snapshots): the only one there
    if commit is None or not (repo / "snapshots" / commit).is_dir():
        raise ValueError(f"model {spec!r}: revision {revision!r} is not in {repo} (snapshots: {snapshots or 'none'})")
    snap = repo / "snapshots" / commit
    if not (snap / "config.json").is_file():
        raise ValueError(f"model {spec!r}: snapshot {snap} has no config.json (an incomplete download?)")
    return snap
