"""The tokenizer's fair queue (server/tokenizer_turns.py): the order turns are given in, the cap
per client, and waiters that leave."""
from __future__ import annotations

import asyncio

import pytest

from spd_engine.server.openai_api import ApiError
from spd_engine.server.tokenizer_turns import TokenizerTurns

pytestmark = pytest.mark.pure


async def served_order(turns: TokenizerTurns, arrivals: list[tuple[str, int]]) -> list[str]:
    """Each (client, size) waits for its turn, in arrival order, while the first holds the worker;
    returns the order they are served in, named client:size."""
    order: list[str] = []
    all_queued = asyncio.Event()

    async def one(client: str, size: int) -> None:
        await turns.acquire(client, size)
        order.append(f"{client}:{size}")
        await all_queued.wait()  # the encode (the first lasts until every other one waits)
        turns.release(client)

    tasks = []
    for client, size in arrivals:
        tasks.append(asyncio.create_task(one(client, size)))
        await asyncio.sleep(0)  # queued in this order
    all_queued.set()
    await asyncio.gather(*tasks)
    assert not turns.busy and not turns.held
    return order


def test_a_small_request_goes_right_after_the_running_encode():
    """Four clients queue two 2 MB prompts each (first come, first served would put the small one
    ninth); the small one is served second, then the large ones take turns client by client."""
    big = 2_000_000
    arrivals = [(c, big) for c in "ABCD" for _ in range(2)] + [("small", 100)]
    order = asyncio.run(served_order(TokenizerTurns(per_client=2), arrivals))
    assert order[:2] == [f"A:{big}", "small:100"], order
    assert [o[0] for o in order[2:]] == ["B", "C", "D", "A", "B", "C", "D"], order


def test_clients_share_by_size_not_by_request_count():
    """A sends ten 1-unit prompts, B one 5-unit prompt: B goes once A has had about its share."""
    arrivals = [("A", 1)] * 10 + [("B", 5)]
    order = asyncio.run(served_order(TokenizerTurns(per_client=100), arrivals))
    assert 4 <= order.index("B:5") <= 7, order


def test_more_than_the_cap_per_client_is_429_and_others_still_pass():
    async def run() -> None:
        turns = TokenizerTurns(per_client=2)
        await turns.acquire("A", 10)  # running
        waiting = asyncio.create_task(turns.acquire("A", 10))
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as err:
            await turns.acquire("A", 10)
        assert err.value.status == 429 and err.value.code == "tokenizer_busy"
        assert err.value.headers == {"Retry-After": "1"}
        other = asyncio.create_task(turns.acquire("B", 1))
        await asyncio.sleep(0)
        turns.release("A")
        await asyncio.wait_for(other, 1)  # B's small prompt before A's second
        assert not waiting.done()
        turns.release("B")
        await asyncio.wait_for(waiting, 1)
        turns.release("A")
        assert not turns.busy and not turns.held

    asyncio.run(run())


def test_a_waiter_that_leaves_gives_up_its_place_and_a_granted_one_passes_the_turn_on():
    async def run() -> None:
        turns = TokenizerTurns(per_client=2)
        await turns.acquire("A", 10)
        leaving = asyncio.create_task(turns.acquire("B", 1))
        after = asyncio.create_task(turns.acquire("C", 5))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        assert "B" not in turns.held
        turns.release("A")
        await asyncio.wait_for(after, 1)  # the one that left is skipped
        granted = asyncio.create_task(turns.acquire("D", 1))
        last = asyncio.create_task(turns.acquire("E", 1))
        await asyncio.sleep(0)
        turns.release("C")  # D is granted the turn ...
        granted.cancel()  # ... and leaves before it runs: E gets it
        await asyncio.wait_for(last, 1)
        turns.release("E")
        assert not turns.busy and not turns.held and granted.cancelled()

    asyncio.run(run())
