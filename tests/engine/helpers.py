"""Shared helpers for the runtime tests: config builders, the greedy oracle, draft policies that
steer acceptance (oracle, forced rejections, recording), the expected tick count computed from a
policy alone, a rank harness that runs each rank in its own process with every
torch.distributed collective patched to raise, and a pool of processes that seeded draws share.

A draft policy `(position, pdm_draft) -> token` decides the draft that will sit at `position`.
Drafts are keyed by position, so the last call for a position is the draft that gets verified
(a flush re-drafts the positions behind a correction). With a reference output `ref` whose first
token sits at position P, token index `i = position - P`; indices 1..N-1 are verified.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.schedule import decode_ticks
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_stage_model
from spd_engine.engine.runtime.launch import RANK_PRELOAD
from spd_engine.engine.runtime.run_config import PRESETS, Drafting, ModelSpec, ParallelLayout, RunConfig, Runtime

ARCHS = ("llama", "qwen2", "qwen3")
CHUNK = 16  # small prefill chunk: prompts longer than 16 tokens take several chunks
CAPACITY = 256
SEED_WORKERS = 2  # processes a sampling test spreads its seeded requests over (the CI host's cores)


# ---- seeded draws over processes ----

def _one_intra_op_thread() -> None:
    torch.set_num_threads(1)  # as the one_thread fixture: SEED_WORKERS processes already fill the cores


@pytest.fixture(scope="module")
def seed_pool():
    """SEED_WORKERS processes a module's sampling tests share, one intra-op thread each, forked
    from the forkserver the launcher's ranks come from (engine/comm/dist.py LocalRanks)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # the launcher's server, if this starts it
    with ctx.Pool(SEED_WORKERS, initializer=_one_intra_op_thread) as pool:
        yield pool


def in_shares(pool, fn: Callable[[list[int]], object], seeds: Sequence[int], unit: int = 1) -> list:
    """fn(share) for SEED_WORKERS contiguous shares of seeds (whole groups of `unit` seeds), each in
    a process of the pool (fn a module-level function or a functools.partial of one); the results
    in seed order. A seeded request draws the same tokens in any process (every draw is keyed by
    seed, position and purpose), so together they are what one process drawing every seed returns."""
    seeds = list(seeds)
    assert len(seeds) % unit == 0, f"{len(seeds)} seeds are not whole groups of {unit}"
    cuts = [unit * (i * (len(seeds) // unit) // SEED_WORKERS) for i in range(SEED_WORKERS + 1)]
    return pool.map(fn, [seeds[a:b] for a, b in zip(cuts, cuts[1:])])


# ---- configs and the oracle ----

def tiny_cfg(arch: str, **overrides) -> ModelConfig:
    """The tiny preset of a family with an untied head. A tied random model only copies its last
    input token (the residual stream is dominated by the embedding, which is also the head), so
    its greedy output is one token repeated and would hide a wrong KV cache or rollback; the tied
    path is covered by the real SmolLM2 tests."""
    return dataclasses.replace(PRESETS[f"tiny-{arch}"], **{"tie_embeddings": False, **overrides})


def tiny_engine_config(arch: str = "llama", n: int = 2, colocate: bool = False, mode: str = "spd",
                       cfg: ModelConfig | None = None, **kw) -> RunConfig:
    """A `random:tiny-<arch>` run config with the shape `cfg` (default `tiny_cfg(arch)`)."""
    cfg = cfg or tiny_cfg(arch)
    topo = Topology.build(cfg.num_layers, n, colocate=colocate)
    # W = 1 unless a test asks: the tick formulas and forced-rejection counts are W = 1's
    # the PDM in fp32 on every host (auto picks int8 or bf16 matmuls by what the CPU has): drafts, and so the
    # tick counts tests assert, stay the same on any x86-64 CPU
    # one token per entry unless a test asks: suffix runs (docs/design.md 3.13) have tests of their own
    # row-major weights unless a test asks: at these 64-wide shapes oneDNN's packed layout (auto's CPU
    # choice) costs about 5x a matmul and a quarter of a test's time; the layouts' own runs are in
    # test_weight_layout.py (each layout lossless through the runtime) and test_row_invariance.py
    base = RunConfig(model=ModelSpec(source=f"random:tiny-{arch}", cfg=cfg, weight_layout="row"),
                     parallel=ParallelLayout(topology=topo), mode=mode,
                     drafting=Drafting(branches=1, pdm_dtype="float32", suffix_run=1),
                     runtime=Runtime(capacity=CAPACITY, prefill_chunk=CHUNK, timeout_s=20.0))
    return base.replace(**kw) if kw else base  # a test's settings, by their own names (RunConfig.replace)


_FULL: dict[tuple, torch.nn.Module] = {}


def full_model(ecfg: RunConfig):
    """The whole target (embedding, every layer, head) with the weights the stages get."""
    key = (ecfg.model.source, ecfg.model.cfg.fingerprint(), ecfg.runtime.seed, ecfg.resolved_weight_layout)
    if key not in _FULL:
        _FULL[key] = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    return _FULL[key]


def reference(ecfg: RunConfig, prompt: Sequence[int], max_new: int, eos: Sequence[int] = ()) -> list[int]:
    """greedy_generate on the full model, same prefill chunk and the ranks' intra-op thread count
    (a BLAS call's bits depend on it, docs/testing.md): the output SPD must reproduce."""
    before = torch.get_num_threads()
    torch.set_num_threads(ecfg.parallel.threads or before)  # threads None: ranks are threads of this process
    try:
        return greedy_generate(full_model(ecfg), prompt, max_new, eos_ids=eos, chunk=ecfg.runtime.prefill_chunk)
    finally:
        torch.set_num_threads(before)


def random_prompts(cfg: ModelConfig, lengths: Iterable[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, cfg.vocab_size, (length,), generator=gen).tolist() for length in lengths]


# ---- draft policies ----

def wrong_token(token: int, vocab: int) -> int:
    return (token + 1) % vocab


@dataclass
class Policy:
    """Oracle draft policy with forced rejections at token indices `wrong` (or, with
    `oracle=False`, the PDM's own draft everywhere except those indices). Records every call, so
    the verified draft of each position (the last one made) is known afterwards."""

    ref: list[int]
    P: int  # position of ref[0]
    vocab: int
    wrong: frozenset[int] = frozenset()
    oracle: bool = True
    drafts: dict[int, int] = field(default_factory=dict)  # token index -> last draft made for it

    def __call__(self, position: int, pdm_draft: int) -> int:
        i = position - self.P
        assert i >= 1, f"a draft was asked for position {position}, before the first generated token"
        token = pdm_draft
        if i < len(self.ref):
            if i in self.wrong:
                token = wrong_token(self.ref[i], self.vocab)
            elif self.oracle:
                token = self.ref[i]
        self.drafts[i] = token
        return token

    def rejected(self, N: int) -> list[int]:
        """Token indices 1..N-1 whose verified draft differs from the reference."""
        return [i for i in range(1, N) if self.drafts[i] != self.ref[i]]


def expected_ticks(policy: Policy, N: int, n: int) -> int:
    """decode_ticks with R counted from the policy: rejections followed by another committed token."""
    R = sum(1 for i in policy.rejected(N) if i < N - 1)
    return decode_ticks(N, n, R)


def check_run(res: GenerationResult, want: list[int], policy: Policy, n: int) -> None:
    """Lossless, tick count from the formula, and the counters consistent with the policy."""
    first = next((i for i, (a, b) in enumerate(zip(res.tokens, want)) if a != b), min(len(res.tokens), len(want)))
    assert res.tokens == want, f"SPD output differs from greedy at index {first}"
    N = len(want)
    rejected = policy.rejected(N)
    assert res.ticks == expected_ticks(policy, N, n), (res.ticks, N, n, rejected)
    assert res.verified == N - 1
    assert res.accepted == N - 1 - len(rejected)
    assert res.rejections == sum(1 for i in rejected if i < N - 1)


def summary(res: GenerationResult) -> dict:
    return dict(tokens=res.tokens, ticks=res.ticks, verified=res.verified, accepted=res.accepted,
                rejections=res.rejections)


def solo_results(runtime, reqs) -> list[GenerationResult]:
    """Each of several requests (BatchRequest) run alone, one after the other: what a batch must equal."""
    return [runtime.generate(r.prompt, r.max_new_tokens, r.eos_ids, draft_policy=r.draft_policy, sampling=r.sampling)
            for r in reqs]


def assert_processes_equal_threads(ecfg: RunConfig, reqs, max_batch: int = 2) -> None:
    """A batch run with ranks as processes equals the reference executor's (ranks in one process), request
    for request, and a single request after it equals the batch's first."""
    from spd_engine.engine.runtime.launch import launch  # spawns processes: only the tests that do
    from spd_engine.engine.runtime.reference import ReferenceExecutor

    with ReferenceExecutor(ecfg) as ex:
        want = [summary(r) for r in ex.generate_batch(reqs, max_batch).results]
    with launch(ecfg) as runtime:
        got = runtime.generate_batch(reqs, max_batch)
        after = runtime.generate(reqs[0].prompt, reqs[0].max_new_tokens)  # a single request after a batch run
    assert [summary(r) for r in got.results] == want
    assert after.tokens == want[0]["tokens"]


# ---- rank harness without collectives ----

COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "barrier", "reduce", "scatter", "gather", "all_to_all",
               "all_gather_into_tensor", "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
               "monitored_barrier")


class CollectiveCalled(AssertionError):
    """Raised by a patched collective; not caught by the engine (it handles transport errors only)."""


def forbid_collectives(log: Path, allow: tuple[str, ...] = ()) -> dict:
    """Make every collective but those in `allow` raise in this process (both the public and the
    c10d module names), logging the name first so the parent can tell which one was called.
    Returns the originals."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    originals = {}
    for name in COLLECTIVES:
        if name in allow:
            continue
        def stub(*args, _name=name, **kwargs):
            with open(log, "a") as f:
                f.write(_name + "\n")
            raise CollectiveCalled(f"torch.distributed.{_name} called")
        for module in (dist, c10d):
            if hasattr(module, name):
                originals[(module, name)] = getattr(module, name)
                setattr(module, name, stub)
    return originals


def restore(originals: dict) -> None:
    for (module, name), fn in originals.items():
        setattr(module, name, fn)


def _rank_main(rank: int, world: int, port: int, ecfg: RunConfig, job: Callable, job_args: tuple,
               out_dir: str, allow: tuple[str, ...] = ()) -> None:
    """One rank: patch collectives (but `allow`), then run the engine's own torchrun path of `launch`."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    out = Path(out_dir)
    forbid_collectives(out / f"collectives-{rank}.log", allow)
    from spd_engine.engine.runtime.launch import launch

    try:
        with launch(ecfg) as runtime:  # ranks other than 0 serve inside and exit
            result = job(runtime, *job_args)
        torch.save(result, out / "result.pt")
    except Exception:  # SystemExit(0) is how a stage rank leaves `launch`: not an error
        (out / f"error-{rank}.log").write_text(traceback.format_exc())
        raise


@dataclass
class RanksOutcome:
    exitcodes: list[int | None]
    result: object
    collectives: dict[int, list[str]]
    errors: dict[int, str]


def run_ranks(ecfg: RunConfig, job: Callable, job_args: tuple, out_dir: Path, timeout: float = 120.0,
              allow: tuple[str, ...] = ()) -> RanksOutcome:
    """Run every rank of `ecfg` as its own spawned process (as torchrun would), with collectives
    patched to raise (but those in `allow`: a stage's TP group all_gathers); rank 0 runs
    `job(runtime, *job_args)` and its return value comes back."""
    from spd_engine.engine.runtime.launch import free_port

    world, port = ecfg.world_size, free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, ecfg, job, job_args, str(out_dir), allow),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    result_file = out_dir / "result.pt"
    result = torch.load(result_file, weights_only=False) if result_file.is_file() else None
    logs = {r: (out_dir / f"collectives-{r}.log") for r in range(world)}
    errs = {r: (out_dir / f"error-{r}.log") for r in range(world)}
    return RanksOutcome([p.exitcode for p in procs], result,
                        {r: f.read_text().split() for r, f in logs.items() if f.is_file()},
                        {r: f.read_text() for r, f in errs.items() if f.is_file()})


def idle_wait_rank(rank: int, port: int, pause_s: float, out: str) -> None:
    """Two gloo ranks whose group times out after 2 s: rank 1 waits idle (no timeout, as a stage
    between requests) for a header that rank 0 sends only after `pause_s`; rank 1 records it."""
    import datetime

    import torch.distributed as dist

    from spd_engine.engine.comm.transport import DistTransport
    from spd_engine.engine.protocol.messages import Header, Kind

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=2))
    t = DistTransport(rank, 2)
    if rank == 0:
        time.sleep(pause_s)
        t.send(1, Header(Kind.END, position=7))
        t.flush()
    else:
        # one process group per direction (NCCL would serialise both directions of one group)
        directions = sorted(t._groups) if t._groups[(0, 1)] is not t._groups[(1, 0)] else []
        Path(out).write_text(f"{t.recv_header(0, None).position} {directions}")
    dist.destroy_process_group()


def load_smollm2() -> tuple:
    """(engine checkpoint dir, model config, full model, tokenizer) of SmolLM2-135M-Instruct, once the
    `smollm2_dir` fixture fetched it: what the real-model runtime checks compare against."""
    from spd_engine.engine.model.checkpoint import load_stage_model, read_index
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.tools.model_args import resolve_model

    engine_dir, tok_dir = resolve_model("smollm2-135m")
    cfg = read_index(engine_dir).cfg
    return engine_dir, cfg, load_stage_model(engine_dir, range(0, cfg.num_layers)).eval(), Tokenizer.from_dir(tok_dir)
