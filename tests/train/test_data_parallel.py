"""Data-parallel training's process group ends with the run: after `DataParallel.close` no gloo
thread is left for the interpreter's exit to tear down (a rank used to abort there now and then,
"terminate called without an active exception", when torch modules imported after the group was
made, as AdamW's construction does, kept the group alive)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# run under torchrun: join, build an optimizer after joining (it imports torch._dynamo, which
# imports the module whose default arguments capture the world group), step once, leave
RANK = """
import os, sys, torch
from spd_engine.train.data_parallel import DataParallel

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)

dp = DataParallel.from_env("cpu", timeout_s=60)
assert gloo_threads(), "the group should run gloo threads while it is up"
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 4)).sum().backward()
dp.average_gradients(model.parameters())
opt.step()
dp.close()
with open(os.path.join(sys.argv[1], f"rank{dp.rank}.txt"), "w") as f:  # a file per rank: stdout interleaves
    f.write(repr(gloo_threads()))
"""


@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are read from /proc/self/task")
def test_close_ends_every_gloo_thread(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    left = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert left == ["[]", "[]"], left
