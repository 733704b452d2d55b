"""`spd bench --host-load`: the spec's parsing, load processes that really load a core and end with the
benchmark (also when it is killed), and a bench run under load that stays lossless and records no split."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spd_engine.bench.host_load import HostLoad, running
from spd_engine.tools.cli import main


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process pid, from /proc (clock ticks)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_spec_parsing_and_refusals():
    assert HostLoad.parse("2/6") == HostLoad(2.0, 6.0, 1)
    assert HostLoad.parse("1000/0x2") == HostLoad(1000.0, 0.0, 2)
    assert HostLoad.parse("0.5/2").cores == pytest.approx(0.2)
    assert "2 load processes (busy without pause: 2.00 cores)" == HostLoad.parse("5/0x2").describe()
    for bad in ("2", "2/", "a/b", "2/6x", "-1/2", "2/6x0", "0/5", "2/6x999"):
        with pytest.raises(ValueError, match="--host-load"):
            HostLoad.parse(bad)


def test_load_processes_burn_cpu_and_stop_with_the_block():
    load = HostLoad(5.0, 5.0, 2)
    with running(load) as procs:
        assert len(procs) == 2
        # about half a core each on a quiet host; a busy one gives them less, so wait for the CPU time
        # itself (an observable state), not for a fixed second
        deadline = time.monotonic() + 60
        while (burnt := [_cpu_seconds(p.pid) for p in procs]) and min(burnt) <= 0.1 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [p.pid for p in procs]
    assert all(b > 0.1 for b in burnt), burnt
    assert all(_gone(pid, 0.1) for pid in pids)
    with running(None) as procs:
        assert procs == []


def test_a_killed_benchmark_leaves_no_load_behind(tmp_path):
    """The load processes watch their parent: SIGKILL of the benchmark ends them too."""
    script = ("import time\nfrom spd_engine.bench.host_load import HostLoad, running\n"
              "with running(HostLoad(1.0, 1.0, 1)) as procs:\n"
              "    print(procs[0].pid, flush=True)\n    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        assert _gone(child, 5.0), "a load process outlived its killed benchmark"
    finally:
        parent.kill()


@pytest.mark.multiproc
def test_bench_under_a_host_load_is_lossless_and_records_no_split(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "random:tiny-llama", "--stages", "2", "--threads", "1", "--prompt", "hello",
                 "--max-new-tokens", "8", "--repeats", "1", "--configs", "ar,spd-colocate", "--host-load", "1/3",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["host_load"] == {"busy_ms": 1.0, "idle_ms": 3.0, "processes": 1, "cores": 0.25}
    assert all(r["lossless"] for r in report["rows"])
    printed = capsys.readouterr().out
    assert "every row under 1 load process (busy 1 ms, idle 3 ms: 0.25 cores)" in printed
    assert "recorded for --stage-layers balanced" not in printed
    assert main(["bench", "--model", "random:tiny-llama", "--prompt", "x", "--host-load", "fast"]) == 2
