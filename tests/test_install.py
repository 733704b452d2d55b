"""A plain `pip install .` (not editable) of a copy of the checkout into a fresh virtual
environment (slow): no generic top-level modules, `spd` works, and the shipped heads and prompt
sets are found inside site-packages (docs/install.md)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
from test_packaging import NAMESPACE, ROOT


def _source_files() -> list[Path]:
    """The checkout as a fresh clone would hold it: tracked and untracked, not ignored."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, check=True, capture_output=True).stdout
        return [Path(p) for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    skip = {".venv", "build", "dist", ".git", "__pycache__", ".pytest_cache"}
    return [p.relative_to(ROOT) for p in ROOT.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(cmd: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


PROBE = """
import json, sysconfig
from spd_engine.train.evaluate import default_data_dir
from spd_engine.tools.data import DEFAULT_EVAL_DIR
from spd_engine.tools.model_args import default_head
print(json.dumps({"purelib": sysconfig.get_paths()["purelib"], "eval_dir": str(default_data_dir()),
                  "data_eval_dir": str(DEFAULT_EVAL_DIR), "head": default_head("smollm2-135m", 4)}))
"""


@pytest.mark.slow
def test_plain_install_into_a_fresh_venv(tmp_path):
    """`pip install .` (not editable) from a copy of the checkout: no generic top-level modules,
    `spd` works, and the shipped head and prompt sets are found inside site-packages."""
    import torch

    src = tmp_path / "src"
    for rel in _source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py, spd = env_dir / "bin" / "python", env_dir / "bin" / "spd"
    # the torch this suite runs on (its public version), so the install needs no other build
    torch_pin = "torch==" + torch.__version__.split("+")[0]
    for cmd in ([py, "-m", "pip", "install", "-q", torch_pin], [py, "-m", "pip", "install", "-q", src]):
        r = _run(cmd, tmp_path)
        assert r.returncode == 0, r.stderr[-4000:]

    outside = tmp_path / "elsewhere"  # not the checkout: nothing importable from the working directory
    outside.mkdir()
    for generic in ("tools", "train", "bench", "engine", "ops", "checkpoint_tools", "heads"):
        r = _run([py, "-c", f"import {generic}"], outside)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (generic, r.stdout, r.stderr)
    purelib = Path(json.loads(_run([py, "-c", "import json, sysconfig; print(json.dumps(sysconfig.get_paths()"
                                              "['purelib']))"], outside).stdout))
    dist_info = next(purelib.glob("spd_engine-*.dist-info"))
    tops = {line.split(",")[0].split("/")[0] for line in (dist_info / "RECORD").read_text().splitlines() if line}
    assert tops <= {NAMESPACE, dist_info.name, ".."}, tops  # ../../../bin/spd: the entry point

    for cmd in ([spd, "--help"], [spd, "eval", "--help"], [spd, "data", "--help"], [spd, "generate", "--help"]):
        r = _run(cmd, outside, timeout=300)
        assert r.returncode == 0 and "usage:" in r.stdout, (cmd, r.stdout, r.stderr)

    r = _run([py, "-c", PROBE], outside, timeout=300)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    site = Path(found["purelib"]) / NAMESPACE
    assert Path(found["eval_dir"]) == Path(found["data_eval_dir"]) == site / "train" / "evalsets"
    for name in ("mt_bench", "humaneval", "gsm8k"):
        shipped = ROOT / "train" / "evalsets" / f"{name}.jsonl"
        assert _sha(site / "train" / "evalsets" / f"{name}.jsonl") == _sha(shipped), name
    head = Path(found["head"])
    assert head == site / "heads" / "smollm2-135m-n4", found["head"]
    weights = next(p.name for p in (ROOT / "heads" / "smollm2-135m-n4").glob("pdm.safetensors*"))  # or its .zlib
    for name in ("pdm.json", weights):
        assert _sha(head / name) == _sha(ROOT / "heads" / "smollm2-135m-n4" / name), name
