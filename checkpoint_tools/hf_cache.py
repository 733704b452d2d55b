"""Find a model id (`org/name`, optionally `@revision`) in the local Hugging Face cache; never download.

The layout is huggingface_hub's: `<hub cache>/models--org--name/refs/<branch>` holds a commit hash
and `snapshots/<commit>/` the files (links into `blobs/`). The hub cache is `$HF_HUB_CACHE`
(or the older `$HUGGINGFACE_HUB_CACHE`), else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
else `~/.cache/huggingface/hub`, as huggingface_hub decides it. A miss is a `ValueError` that says
where it looked. A revision, a ref and every file of the snapshot must resolve inside the model's
directory of the cache, and a ref must hold a commit hash; anything else is refused.
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
    inside(ref, repo / "refs", spec)
    commit = ref.read_text().strip() if ref.is_file() else revision if COMMIT.match(revision) else None
    if commit is not None and not COMMIT.match(commit):
        raise ValueError(f"model {spec!r}: {ref} does not hold a commit hash (40 hex digits): {commit[:60]!r}")
    snapshots = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
    if commit is None and revision == "main" and len(snapshots) == 1 and COMMIT.match(snapshots[0]):
        commit = snapshots[0]  # a cache filled without refs (e.g. copied snapshots): the only one there
    if commit is None or not (repo / "snapshots" / commit).is_dir():
        raise ValueError(f"model {spec!r}: revision {revision!r} is not in {repo} (snapshots: {snapshots or 'none'})")
    snap = repo / "snapshots" / commit
    for path in [snap, *snap.rglob("*")]:  # the snapshot's links lead into the repository's blobs/, nowhere else
        inside(path, repo, spec)
    if not (snap / "config.json").is_file():
        raise ValueError(f"model {spec!r}: snapshot {snap} has no config.json (an incomplete download?)")
    return snap


def inside(path: Path, root: Path, spec: str) -> None:
    """ValueError unless `path`, its links followed, stays under `root`: a revision or a link in the
    cache never leads the engine to a file elsewhere."""
    real, top = path.resolve(), root.resolve()
    if real != top and top not in real.parents:
        raise ValueError(f"model {spec!r}: {path} leads outside the Hugging Face cache ({top}); refused")
