"""The flake detector: the default test run N times, quiet or beside a busy neighbour, and every test
that failed in any of them.

A check that passes or fails with the host's speed shows up only over repeated runs and under load,
so this runs the default pytest command (without -x: every failure of a run counts) `--runs` times,
each writing a JUnit XML file, optionally with `--neighbour K` processes that each keep one core
busy for the whole run, and reports each test that failed or errored in at least one run with the
number of runs it failed in. Exit status 0 when every run passed everything, 1 otherwise.

    python tests/flake_check.py --runs 3 --out runs/flakes             # quiet host
    python tests/flake_check.py --runs 2 --neighbour 1 --out runs/flakes-busy
    make flake-check RUNS=3 NEIGHBOUR=1                                 # the same through make
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTEST = ["-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
BUSY = "while True:\n    pass\n"  # one core's worth of a neighbour
PYTEST = str(Path(sys.executable).with_name("pytest"))  # the environment's, never `python -m` from the root


def failed_tests(junit: Path) -> list[str]:
    """`file::name` of every test case that failed or errored in one JUnit XML report."""
    root = ET.parse(junit).getroot()
    out = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return out


def run_once(k: int, out: Path, pytest_args: list[str], neighbours: int) -> tuple[int, float, list[str]]:
    """One default run (with `neighbours` busy processes beside it): its exit code, seconds and failures."""
    junit = out / f"run-{k}.xml"
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(neighbours)]
    t0 = time.monotonic()
    try:
        with (out / f"run-{k}.log").open("w") as log:
            code = subprocess.run([PYTEST, *pytest_args, f"--junitxml={junit}"],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    finally:
        for p in busy:
            p.kill()
            p.wait()
    seconds = time.monotonic() - t0
    return code, seconds, failed_tests(junit) if junit.exists() else ["(no report: the run ended early)"]


def report(runs: list[tuple[int, float, list[str]]], neighbours: int) -> str:
    counts = Counter(name for _, _, failed in runs for name in failed)
    lines = [f"# Flake check: {len(runs)} runs, {neighbours} busy neighbour process(es)", "",
             "| run | exit | seconds | failed |", "|---|---|---|---|"]
    lines += [f"| {k} | {code} | {sec:.0f} | {len(failed)} |" for k, (code, sec, failed) in enumerate(runs)]
    lines += ["", "| test | failed in |", "|---|---|"] if counts else ["", "Every test passed in every run."]
    lines += [f"| `{name}` | {c} of {len(runs)} |" for name, c in counts.most_common()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="default runs, one after another")
    p.add_argument("--neighbour", type=int, default=0, metavar="K", help="busy processes beside each run")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "flakes", help="reports, logs and report.md")
    p.add_argument("pytest_args", nargs="*", help="after --: pytest arguments in place of the default run's")
    args = p.parse_args(argv)
    if args.runs < 1 or args.neighbour < 0:
        p.error("--runs must be at least 1 and --neighbour at least 0")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(args.runs):
        runs.append(run_once(k, args.out, args.pytest_args or DEFAULT_PYTEST, args.neighbour))
        code, sec, failed = runs[-1]
        print(f"run {k}: exit {code}, {sec:.0f} s, {len(failed)} failed", flush=True)
    text = report(runs, args.neighbour)
    tmp = args.out / "report.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, args.out / "report.md")
    print(text, end="")
    return 0 if all(code == 0 for code, _, _ in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
