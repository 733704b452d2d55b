"""The two-rank training command (`spd train` under torchrun, the tiny model and corpus of
tests/train/test_distill.py) run many times, optionally beside busy neighbour processes, counting
the runs that failed or aborted ("terminate called" on a rank). Exit status 0 when none did.

    python tests/train_teardown_stress.py --runs 50 --neighbour 1
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "engine"), str(HERE / "train")]  # the tests' helper modules

from test_corpus import build  # noqa: E402
from test_distill import TRAIN_ARGS, ModTokenizer  # noqa: E402

from spd_engine.engine.runtime.launch import spd_script  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--neighbour", type=int, default=1, metavar="K", help="busy processes beside the runs")
    args = p.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"]) for _ in range(args.neighbour)]
    failed = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            corpus_dir, _ = build(Path(tmp), tok=ModTokenizer())
            for i in range(args.runs):
                t0 = time.monotonic()
                proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node", "2", spd_script(), "train", *TRAIN_ARGS, "--corpus",
                                       str(corpus_dir), "--out", str(Path(tmp) / f"run{i}")],
                                      capture_output=True, text=True, timeout=600)
                bad = proc.returncode != 0 or "terminate called" in proc.stderr
                failed += bad
                print(f"run {i}: exit {proc.returncode}, {time.monotonic() - t0:.1f} s"
                      + (f", FAILED: {proc.stderr[-1500:]}" if bad else ""), flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    print(f"{failed} of {args.runs} runs failed or aborted ({args.neighbour} busy neighbour process(es))")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
