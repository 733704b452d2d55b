"""README.md stays a two-minute read: at most 7,000 characters, exactly the two set-up commands
(`make demo`, `make test`, both Makefile targets), and its picture a file the repository tracks."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_short():
    assert len(README) <= 7000, len(README)


def test_two_set_up_commands_that_the_makefile_has():
    setup = README[README.index("## Set-up"):README.index("\n## ", README.index("## Set-up") + 1)]
    commands = re.findall(r"^    (make \S+)", setup, re.M)
    assert commands == ["make demo", "make test"], commands
    makefile = (ROOT / "Makefile").read_text()
    assert all(re.search(rf"^{c.split()[1]}:", makefile, re.M) for c in commands)


def test_its_picture_is_tracked():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert images, "the README shows the tick schedule"
    tracked = subprocess.run(["git", "ls-files", *images], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert sorted(tracked) == sorted(images) or not (ROOT / ".git").exists(), (images, tracked)
