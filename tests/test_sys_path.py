"""The repository root is never on sys.path (docs/design.md 4): the suite, the commands it spawns
and every documented command find the package through the install, so the repository's folders
never shadow installed packages of the same names (`kernels`, which transformers imports)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from test_install import ROOT, _source_files

# Commands that put the working directory first on sys.path; from the repository root its folders
# would shadow installed packages of the same names (`kernels`, which transformers imports).
ROOT_ON_PATH = re.compile(r"python3?\s+-m\s+(spd_engine|pytest)\b|[\"']-m[\"'],\s*[\"'](spd_engine|pytest)\b")


def _root_on(path: list[str]) -> bool:
    return ROOT in {Path(p or os.getcwd()).resolve() for p in path}


def _sys_path() -> list[str]:
    return list(sys.path)


def test_the_suite_and_the_ranks_it_forks_run_without_the_repository_root_on_sys_path():
    """tests/conftest.py takes the root off before every test (pytest puts it there); a rank forked from
    this process's forkserver gets the sys.path the forkserver started with, which must not hold it
    either (the forkserver starts at a test's first launch, after the conftest filter)."""
    import multiprocessing

    from spd_engine.engine.runtime.launch import RANK_PRELOAD

    assert not _root_on(sys.path)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # the launcher's server, if this starts it
    with ctx.Pool(1) as pool:
        forked = pool.apply(_sys_path)
    assert not _root_on(forked), forked


def test_kernels_imports_the_installed_package_not_the_folder():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin).resolve() != (ROOT / "kernels" / "__init__.py").resolve(), spec.origin


def test_the_kernels_folder_refuses_to_stand_in_for_the_pypi_package(tmp_path):
    (tmp_path / "kernels").symlink_to(ROOT / "kernels")
    out = subprocess.run([sys.executable, "-c", "import kernels"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and "repository root is on sys.path" in out.stderr


def test_no_command_the_project_runs_or_documents_puts_the_root_on_sys_path():
    files = [p for p in _source_files() if p.suffix in (".py", ".md", ".cfg", ".toml", "") and p.name != "test_sys_path.py"
             and p.parts[0] not in ("heads",)]
    assert any(p.name == "Makefile" for p in files) and any(p.suffix == ".md" for p in files)
    bad = [f"{p}:{i}: {line.strip()}" for p in files for i, line in enumerate((ROOT / p).read_text(errors="replace")
                                                                            .splitlines(), 1)
           if ROOT_ON_PATH.search(line)]
    assert not bad, "run `spd` / `pytest` (or spd_command()), never python -m from the root:\n" + "\n".join(bad)
    assert ROOT_ON_PATH.search('cmd = [sys.executable, "-m", "spd_engine.tools.cli"]')
    assert ROOT_ON_PATH.search("python -m pytest -q") and not ROOT_ON_PATH.search("python -m pip install x")
