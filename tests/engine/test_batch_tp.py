"""Several requests in the pipeline with tensor-parallel stages (engine/runtime/batch_driver.py,
docs/design.md 3.9 and 3.12): every TP rank of a stage takes a BATCH message's table and rows from
TP rank t of the stage before (stage 0: from the driver), holds its shard of every request slot's
KV cache and computes the same step; every request's output, ticks and verifications equal its
own solo run's with the same split (greedy: greedy decoding with the same TP split,
tp_cases.tp_reference, the oracle of test_tp_runtime.py), greedy and seeded, requests joining and leaving at different
ticks, co-located and not, ranks as threads and as processes.
"""
from __future__ import annotations

import threading

import pytest
import torch
from helpers import CHUNK, Policy, assert_processes_equal_threads, random_prompts, solo_results, summary
from test_batch_branches import branched
from test_batch_runtime import seeded_requests
from tp_cases import tp_engine_config, tp_reference

from spd_engine.engine.comm.tp_group import LocalTPHub
from spd_engine.engine.model.tp_sampling import tp_argmax_rows
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.reference import ReferenceExecutor

NEW = 24
TP = 2


def requests(ecfg, oracle: bool = True) -> list[BatchRequest]:
    """Four greedy requests of one to three prefill chunks, arriving at ticks 1, 5, 9, 13, of
    different lengths; the second accepts every draft and the third rejects three (their policies
    over the TP oracle's output; `oracle` False: the PDM's own drafts but the forced rejections),
    the others draft with the untrained PDM."""
    prompts = random_prompts(ecfg.model.cfg, (5, 2 * CHUNK + 3, 9, CHUNK + 1), seed=3)
    out = []
    for i, (p, new) in enumerate(zip(prompts, (NEW, NEW - 7, NEW, 9))):
        policy = None
        if i in (1, 2):
            policy = Policy(tp_reference(ecfg, p, new), len(p), ecfg.model.cfg.vocab_size, oracle=oracle,
                            wrong=frozenset({2, 3, 11}) if i == 2 else frozenset())
        out.append(BatchRequest(p, new, arrival_tick=1 + 4 * i, draft_policy=policy))
    return out


@pytest.mark.parametrize("tp", [2, 3])
def test_the_rows_argmax_across_shards_is_torch_argmax(tp):
    """tp_argmax_rows: every row's argmax of the full logits, a tie going to the lowest id (across
    shards and inside one), the same ids on every TP rank."""
    V, gen = 12 * tp, torch.Generator().manual_seed(tp)
    logits = torch.randn(6, V, generator=gen)  # [R, V]
    logits[1, [3, V - 2]] = logits[2, [5, 6]] = logits[3, [0, V - 1]] = 9.0  # ties: across shards, inside one
    hub, out = LocalTPHub(range(tp), 30.0), [None] * tp

    def body(r: int) -> None:
        lo = r * (V // tp)
        out[r] = tp_argmax_rows(hub.group(r), logits[:, lo:lo + V // tp], lo)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for got in out:
        assert got.tolist() == logits.argmax(-1).tolist() and got.dtype == torch.int64


@pytest.mark.parametrize("colocate", [False, True], ids=["driver", "co"])
def test_tp_every_request_equals_itself_alone(colocate, one_thread):
    ecfg = tp_engine_config("spd", 2, TP, colocate)
    reqs = requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        for r, got in zip(reqs, alone):  # solo: greedy decoding with the same TP split
            assert got["tokens"] == tp_reference(ecfg, r.prompt, r.max_new_tokens)
        for B in (2, 4):
            out = ex.generate_batch(reqs, B)
            assert [summary(r) for r in out.results] == alone, (colocate, B)
            assert max(out.rows) == B  # B requests really shared the TP stages' steps
        bound = ex.generate_batch(reqs, 4, max_rows=2)  # the row bound holds requests back
    assert [summary(r) for r in bound.results] == alone
    assert max(bound.rows) == 2 and sum(bound.held) > 0
    assert any(s["rejections"] >= 3 for s in alone) and any(s["accepted"] == s["verified"] > 0 for s in alone)


@pytest.mark.parametrize("colocate", [False, True], ids=["driver", "co"])
def test_tp_seeded_sampling_equals_itself_alone(colocate, one_thread):
    ecfg = tp_engine_config("spd", 2, TP, colocate)
    reqs = seeded_requests(ecfg) + [BatchRequest(r.prompt, r.max_new_tokens, arrival_tick=r.arrival_tick)
                                    for r in requests(ecfg)[1:2]]  # and a greedy one beside them
    with ReferenceExecutor(ecfg) as ex:
        alone = [summary(r) for r in solo_results(ex, reqs)]
        out = ex.generate_batch(reqs, 4)
    assert [summary(r) for r in out.results] == alone
    assert alone[-1]["tokens"] == tp_reference(ecfg, reqs[-1].prompt, reqs[-1].max_new_tokens)


def test_tp_batch_step_collectives_do_not_grow_with_its_rows(one_thread):
    """A BATCH step on a TP stage: two all-reduces per layer, one for stage 0's vocab-parallel
    embedding, and at a last stage that verifies one all_gather for every row's argmax."""
    ecfg = tp_engine_config("spd", 2, TP, True)  # co-located: the last stage verifies
    assert ecfg.verifies_on_last
    with ReferenceExecutor(ecfg) as ex:
        out = ex.generate_batch(requests(ecfg), 4)
    topo = ecfg.parallel.topology
    for s, stats in enumerate(out.stages):
        per = 2 * len(topo.layers_of(s)) + (s == 0) + (s == topo.n - 1)
        assert stats["tp_collectives"] == per * stats["messages"] and stats["rows"] > stats["messages"], (s, stats)


def test_tp_branch_width_2_every_request_equals_itself_alone(one_thread):
    """A request's branch point chains next to the other requests' rows on the TP stages' steps."""
    ecfg = tp_engine_config("spd", 2, TP, False, branches=2, branch_when="always")
    reqs = requests(ecfg, oracle=False)
    with ReferenceExecutor(ecfg) as ex:
        alone = solo_results(ex, reqs)
        out = ex.generate_batch(reqs, 4)
    assert [branched(r) for r in out.results] == [branched(r) for r in alone]
    assert sum(r.branch_points for r in alone) > 0 and max(out.rows) > 4


@pytest.mark.multiproc
def test_tp_processes_equal_threads():
    ecfg = tp_engine_config("spd", 2, TP, False, threads=1)
    assert_processes_equal_threads(ecfg, requests(ecfg)[:3] + seeded_requests(ecfg)[:1])
