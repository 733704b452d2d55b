"""Faults and bad input: a SIGKILLed stage process ends every rank within the receive timeout with
an error naming (rank, peer, tick); bad arguments give exit code 2 and one line, no traceback."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import random_prompts, reference, run_ranks, tiny_engine_config

from spd_engine.engine.comm.transport import TransportError
from spd_engine.engine.model.pdm import random_pdm, save_pdm
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.launch import FAULT_ENV, spd_command
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, Runtime
from spd_engine.engine.runtime.stage_worker import StageWorker

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0  # receive timeout inside a request
KILLED = 2  # rank 2 = stage 1 of 3: it has a stage on either side and the driver
ERROR = re.compile(r"\(rank=(\d+), peer=(\d+), tick=(-?\d+)\)")


def cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`spd` leading a new process group, so every rank it starts can be found (and cleaned up) by group."""
    return subprocess.Popen([*spd_command(), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            start_new_session=True)


def group_members(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def wait_group_gone(pgid: int, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def killed_run():
    """`spd generate` on 3 stages with rank 2 SIGKILLing itself mid-generation; stderr lines are
    timestamped as they arrive."""
    proc = cli("generate", "--model", "random:tiny-llama", "--stages", "3", "--max-new-tokens", "400",
               "--prompt", "a prompt", "--timeout", str(TIMEOUT_S), "--capacity", "512", "--threads", "1",
               "--quiet", env={FAULT_ENV: f"{KILLED}:25"})
    start = time.monotonic()
    lines = []
    try:
        for line in proc.stderr:  # ends when every process holding the pipe has exited
            lines.append((time.monotonic() - start, line.rstrip("\n")))
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    leftover = wait_group_gone(proc.pid, 5.0)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    return dict(rc=proc.returncode, end=time.monotonic() - start, lines=lines, leftover=leftover)


def reported(lines) -> dict[int, tuple[int, int, float]]:
    """rank -> (peer, tick, time of the line) for every line naming (rank, peer, tick)."""
    out = {}
    for t, line in lines:
        for rank, peer, tick in ERROR.findall(line):
            out.setdefault(int(rank), (int(peer), int(tick), t))
    return out


def test_killed_stage_ends_the_run_within_the_timeout(killed_run):
    r = killed_run
    text = "\n".join(line for _, line in r["lines"])
    assert r["rc"] != 0, text
    assert r["leftover"] == [], "ranks still running after the driver exited"
    errors = reported(r["lines"])
    assert KILLED not in errors  # it was killed, it reports nothing
    # the stage after the killed one and the driver name their rank, the peer they lost, the tick
    assert errors[3][0] == KILLED and errors[3][1] >= 0, text
    assert 0 in errors, text
    first_error = min(t for _, _, t in errors.values())
    assert r["end"] - first_error <= TIMEOUT_S, (r["end"], first_error)


# Not strict: whether stage 0 notices depends on where it is when the stage dies (mid-send to the dead
# rank it fails at once and reports); in most runs it sits in a receive from the driver and does not.
def test_every_surviving_rank_names_rank_peer_and_tick(killed_run):
    errors = reported(killed_run["lines"])
    assert set(errors) == {0, 1, 3}, errors


def test_killed_stage_under_torchrun_style_launch(tmp_path, capfd, monkeypatch):
    """Every rank a separate process (the torchrun path of `launch`): nobody is killed from outside,
    so each survivor must notice the dead peer on its own."""
    monkeypatch.setenv(FAULT_ENV, f"{KILLED}:25")
    ecfg = tiny_engine_config("llama", 3, timeout_s=TIMEOUT_S, threads=1)
    prompt = random_prompts(ecfg.model.cfg, [9])[0]
    # ranks still alive at the harness deadline (start-up + the receive timeout) are SIGKILLed by it
    out = run_ranks(ecfg, generate_once, (prompt,), tmp_path, timeout=45 + TIMEOUT_S)
    err = capfd.readouterr().err
    assert out.exitcodes[KILLED] == -signal.SIGKILL, (out.exitcodes, out.errors, err[-3000:])
    assert all(code == 1 for r, code in enumerate(out.exitcodes) if r != KILLED), out.exitcodes  # own error exit
    errors = reported([(0.0, line) for line in err.splitlines()])
    assert set(errors) == {0, 1, 3}, err[-3000:]
    assert errors[3][0] == KILLED and out.result is None


def generate_once(runtime, prompt: list[int]):
    return runtime.generate(prompt, 200).tokens


# ---- bad arguments: exit code 2, one line, no traceback ----

@pytest.fixture(scope="module")
def wrong_heads(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    other_model = save_pdm(random_pdm(PRESETS["tiny-qwen2"], (2, 2, 2)), root / "other-model")
    other_n = save_pdm(random_pdm(PRESETS["tiny-llama"], (3, 3)), root / "other-n")
    return {"model": other_model, "n": other_n}


BASE = ["--model", "random:tiny-llama", "--prompt", "hello", "--quiet", "--capacity", "256"]
# arguments after `generate` -> a phrase the one-line error must contain; all fail before any rank starts
EARLY = {
    "too many stages": (BASE + ["--stages", "7"], "more than the model's 6 layers"),
    "missing checkpoint": (["--model", "/nonexistent/ckpt", "--prompt", "hello"], "not found"),
    "missing head": (BASE + ["--spec", "/nonexistent/head"], "not found"),
    "missing prompts file": (BASE + ["--prompts-file", "/nonexistent/prompts.txt"], "not found"),
    "over capacity": (BASE + ["--capacity", "16", "--max-new-tokens", "20"], "capacity"),
    "zero new tokens": (BASE + ["--max-new-tokens", "0"], "max-new-tokens"),
}


def check_one_line(name: str, rc: int, err: str, phrase: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (name, err)
    assert "Traceback" not in err, (name, err)
    assert len(lines) == 1 and lines[0].startswith("spd generate: error: "), (name, err)
    assert phrase in lines[0], (name, lines[0])


@pytest.mark.parametrize("name", list(EARLY))
def test_bad_arguments_give_one_line_and_exit_code_2(name, capfd):
    from spd_engine.tools.cli import main

    args, phrase = EARLY[name]
    rc = main(["generate", *args])  # the dispatcher itself: what `spd` runs
    check_one_line(name, rc, capfd.readouterr().err, phrase)


def test_wrong_head_gives_one_line_and_exit_code_2(wrong_heads):
    """A head for another model or another n is found only on rank 0, once the ranks run: a real
    process each, so the ranks it started must be gone afterwards too."""
    cases = {"head of another model": (BASE + ["--stages", "3", "--spec", str(wrong_heads["model"])], "another model"),
             "head of another n": (BASE + ["--stages", "3", "--spec", str(wrong_heads["n"])], "n=2 stages")}
    procs = {name: cli("generate", *args) for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        check_one_line(name, proc.returncode, err, cases[name][1])
        assert wait_group_gone(proc.pid, 10.0) == [], name


def test_a_failed_launch_leaves_no_process_group_behind(wrong_heads):
    import multiprocessing as mp

    import torch.distributed as dist

    from spd_engine.engine.runtime.launch import launch

    ecfg = tiny_engine_config("llama", 2, colocate=True, pdm=str(wrong_heads["n"]), cfg=PRESETS["tiny-llama"],
                              threads=1)
    ecfg = ecfg.replace(topology=Topology.build(6, stage_layers=[2, 4], colocate=True))  # the head wants [3, 3]
    try:
        with pytest.raises(ValueError, match="stages with layers"):
            with launch(ecfg):
                pass
        leaked = dist.is_initialized()
    finally:  # leave this process usable for the tests after this one
        if dist.is_initialized():
            dist.destroy_process_group()
        for child in mp.active_children():
            child.terminate()
            child.join(5)
    assert not leaked


def test_defaults_work_for_a_tiny_preset():
    """No --capacity and no --spec: the defaults must fit the preset (its max_position is 512), and the
    tokens printed are the greedy decoder's."""
    from spd_engine.engine.runtime.request_inputs import encode_prompts

    proc = cli("generate", "--model", "random:tiny-llama", "--stages", "2", "--prompt", "hi there",
               "--max-new-tokens", "6", "--threads", "1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    cfg = PRESETS["tiny-llama"]
    prompt = encode_prompts(["hi there"], None, False, cfg.vocab_size)[0]
    want = reference(tiny_engine_config("llama", 2, cfg=cfg), prompt, 6, cfg.eos_token_ids)
    assert out.strip().splitlines()[0] == str(want)


# ---- in-process: request errors leave the runtime usable; a dead stage thread is reported ----

def test_bad_requests_are_refused_before_any_work():
    ecfg = tiny_engine_config("llama", 2, capacity=32)
    prompt = random_prompts(ecfg.model.cfg, [5])[0]
    with ReferenceExecutor(ecfg) as ex:
        for args, phrase in (((prompt, 0), "max_new_tokens"), (([], 4), "empty"), ((prompt, 28), "capacity"),
                             (([1, 2, ecfg.model.cfg.vocab_size], 4), "vocabulary")):
            with pytest.raises(ValueError, match=phrase):
                ex.generate(*args)
        assert len(ex.generate(prompt, 27).tokens) == 27  # nothing was left in the pipe


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_stage_thread_ends_the_request_with_rank_and_peer(monkeypatch):
    compute = StageWorker._compute_batch  # a decode step
    calls = {"n": 0}

    def failing(self, hdr, t0):
        if self.stage == 1:
            calls["n"] += 1
            if calls["n"] == 12:
                raise RuntimeError("stage 1 broke")
        return compute(self, hdr, t0)

    monkeypatch.setattr(StageWorker, "_compute_batch", failing)
    ecfg = tiny_engine_config("llama", 3, timeout_s=2.0)
    prompt = random_prompts(ecfg.model.cfg, [5])[0]
    start = time.monotonic()
    with ReferenceExecutor(ecfg, lockstep=False) as ex:  # stage ranks as threads
        with pytest.raises(TransportError) as info:
            ex.generate(prompt, 64)
    # the driver names itself and a dead peer (a failed send has no tick: it reports tick=-1)
    assert info.value.rank == 0 and info.value.peer in (1, 2, 3)
    assert ERROR.search(str(info.value))
    assert any("stage 1 broke" in str(e) for e in ex.errors)
    assert time.monotonic() - start < 4 * ecfg.runtime.timeout_s


def test_one_gpu_per_rank_is_checked_before_anything_starts():
    from spd_engine.engine.comm.dist import gpu_for_rank
    from spd_engine.engine.runtime.launch import launch
    from spd_engine.engine.runtime.run_config import RunConfig

    assert gpu_for_rank(2, None, 4, 3) == 2  # one node: rank r on GPU r
    assert gpu_for_rank(5, 1, 2, 6) == 1  # torchrun: LOCAL_RANK on each node
    with pytest.raises(ValueError, match="rank 2 needs GPU 2, this node has 1"):
        gpu_for_rank(2, None, 1, 3)
    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n=2), device="cuda"),
                     runtime=Runtime(capacity=64))
    if torch.cuda.device_count() >= ecfg.world_size:
        pytest.skip("enough GPUs here: the check passes")
    with pytest.raises(ValueError, match="one rank per GPU"):
        with launch(ecfg):
            pass


@pytest.mark.multiproc
def test_an_idle_rank_outlives_the_process_group_timeout(tmp_path):
    # between requests a stage waits without a timeout; gloo would end such a wait at the group's
    # timeout (here 2 s), so idle waits pass their own (days) and the late message still arrives
    import multiprocessing as mp

    from helpers import idle_wait_rank

    from spd_engine.engine.comm.dist import free_port

    ctx, port, out = mp.get_context("spawn"), free_port(), tmp_path / "got.txt"
    procs = [ctx.Process(target=idle_wait_rank, args=(r, port, 4.0, str(out)), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0] and out.read_text() == "7 [(0, 1), (1, 0)]"
