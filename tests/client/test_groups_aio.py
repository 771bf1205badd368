"""The asyncio cluster client (``client.groups.aio``) over real ``blockd serve --cluster``
daemons and a real etcd: the same placement, routing, cluster-wide reads,
streamed steps, re-routing after a move (one request id, never applied twice)
and refusals as the thread client's."""

from __future__ import annotations

import asyncio
import time

import pytest

from blockd.core.types import Allocate, DecodeAppend, PoolConfig
from client.errors import InvalidArgumentError, NotFoundError, UnavailableError
from client.groups.aio import AsyncClusterClient

pytest_plugins = ["tests.support.etcd", "tests.support.groups"]


def test_pools_are_placed_stepped_and_read_across_the_groups(two_groups) -> None:
    sync, _ = two_groups

    async def scenario() -> dict:
        seen: dict = {}
        async with AsyncClusterClient(sync.target, timeout_s=10) as client:
            for name in ("a", "b", "c"):
                await client.create_pool(PoolConfig(name, num_blocks=16, block_size=4))
            seen["groups"] = [await client.group_of(p) for p in ("a", "b", "c")]
            for name in ("a", "b"):
                first = await client.step(name, [Allocate("s", list(range(10)))])
                await client.decode_append(name, ["s"], [7])
                seen.setdefault("versions", []).append((first.version, (await client.get_pool(name)).version))
            async with client.step_stream() as stream:  # a StepStream per group, each step at its owner
                first = await stream.step("c", [Allocate("s", list(range(10)))])
                await stream.decode_append("c", ["s"], [7])
                seen["stream"] = (first.version, (await client.get_pool("c")).version, len(stream._streams))
            seen["pools"] = [s.name for s in await client.list_pools()]
            seen["lookup"] = await client.lookup_prefix(list(range(10)))
            seen["named"] = await client.lookup_prefix(list(range(10)), pools=["b", "c"])
            watch = client.watch("b", 0, timeout_s=5)
            seen["watched"] = (await watch.__anext__()).version
            await watch.aclose()
            with pytest.raises(NotFoundError, match="in no group of cluster"):
                await client.step("nope", [Allocate("s", [1])])
            await client.delete_pool("a")
            with pytest.raises(NotFoundError, match="in no group"):
                await client.get_pool("a")
        return seen

    seen = asyncio.run(scenario())
    assert seen["groups"] == ["g1", "g2", "g1"]
    assert seen["versions"] == [(1, 2), (1, 2)] and seen["stream"] == (1, 2, 1)
    assert seen["pools"] == ["a", "b", "c"]
    assert seen["lookup"] == {"a": 8, "b": 8, "c": 8} and seen["named"] == {"b": 8, "c": 8}
    assert seen["watched"] == 1
    assert [s.name for s in sync.list_pools()] == ["b", "c"]  # what the thread client reads too


def test_steps_follow_a_moved_pool_and_a_resent_change_is_answered_not_applied_again(two_groups) -> None:
    sync, _ = two_groups
    sync.create_pool(PoolConfig("m", num_blocks=16, block_size=4))
    assert sync.group_of("m") == "g1"

    async def scenario() -> tuple:
        async with AsyncClusterClient(sync.target, timeout_s=10) as client:
            first = await client.step("m", [Allocate("s", [1, 2, 3])], request_id="rid-1")
            async with client.step_stream() as stream:
                on_stream = await stream.step("m", [DecodeAppend(["s"], [4])])
                await asyncio.to_thread(sync.move_pool, "m", "g2")
                # the async client's route is stale: g1 refuses (WRONG_GROUP), the step goes to g2
                after = await stream.step("m", [DecodeAppend(["s"], [5])])
                opened = len(stream._streams)
            again = await client.step("m", [Allocate("s", [1, 2, 3])], request_id="rid-1")  # its answer "lost"
            unary = await client.step("m", [DecodeAppend(["s"], [6])])
            return first, on_stream, after, opened, again, unary, await client.group_of("m")

    first, on_stream, after, opened, again, unary, group = asyncio.run(scenario())
    assert (on_stream.version, after.version, unary.version) == (2, 3, 4) and opened == 2
    assert after.incarnation == first.incarnation and group == "g2"
    assert (again.version, again.results[0].slot_mapping) == (first.version, first.results[0].slot_mapping)
    assert sync.get_sequence("m", "s").num_tokens == 6  # every change once


def test_workers_and_watches_follow_their_pool_to_its_new_group(two_groups) -> None:
    """A worker registers and heartbeats through the asyncio cluster client (a
    heartbeat names no pool: it goes to its pool's owner), and a Watch opened
    after a move, on a stale route, is opened again at the new owner."""
    from blockd.core.types import WorkerInfo

    sync, _ = two_groups
    sync.create_pool(PoolConfig("m", num_blocks=16, block_size=4, num_layers=1, num_kv_heads=2, head_dim=4))

    async def scenario() -> tuple:
        async with AsyncClusterClient(sync.target, timeout_s=10) as client:
            info = WorkerInfo("w0", "m", "127.0.0.1:1", 0, 1, 0, 2, incarnation="life-1")
            registered = await client.register_worker(info)
            beat = await client.heartbeat("w0", 0)
            with pytest.raises(NotFoundError, match="did not register through this client"):
                await client.heartbeat("w9", 0)
            await client.step("m", [Allocate("s", [1, 2, 3])])
            await asyncio.to_thread(sync.move_pool, "m", "g2")  # this client's route to m is now stale
            watch = client.watch("m", 0, timeout_s=5)
            first = await watch.__anext__()
            await watch.aclose()
            # registrations are each daemon's: a worker registers again at the new owner (blockd-worker
            # does when its heartbeat is refused there), and its heartbeats follow
            await client.register_worker(info)
            await client.heartbeat("w0", first.version)
            workers = await client.list_workers("m")
            return registered, beat, first, workers, await client.group_of("m")

    registered, beat, first, workers, group = asyncio.run(scenario())
    assert registered.info.worker_id == "w0" and beat.info.worker_id == "w0" and group == "g2"
    assert first.version >= 1 and [w.info.worker_id for w in workers] == ["w0"]


def test_a_dead_groups_pools_are_unavailable_while_the_others_serve(two_groups) -> None:
    sync, (_, g2) = two_groups
    sync.create_pool(PoolConfig("a", num_blocks=16, block_size=4))
    sync.create_pool(PoolConfig("b", num_blocks=16, block_size=4))
    g2.kill()

    async def scenario() -> tuple:
        async with AsyncClusterClient(sync.target, timeout_s=5) as client:
            deadline = time.monotonic() + 15
            while True:  # until g2's lease ends, a call to it fails as any unreachable daemon's
                try:
                    await client.step("b", [Allocate("s", [1])])
                except UnavailableError as err:
                    if "has no live daemon" in str(err):
                        break
                    assert time.monotonic() < deadline, err
                await asyncio.sleep(0.2)
            return (await client.step("a", [Allocate("s", [1, 2])])).version, [s.name for s in
                                                                                await client.list_pools()]

    assert asyncio.run(scenario()) == (1, ["a"])


def test_bad_targets_are_refused_in_words() -> None:
    for bad in ("127.0.0.1:50051", "cluster://127.0.0.1:2379", "cluster://127.0.0.1:2379/bad name"):
        with pytest.raises(InvalidArgumentError):
            AsyncClusterClient(bad)
    client = AsyncClusterClient("cluster://127.0.0.1:1/c")  # the directory is read on first use
    with pytest.raises(InvalidArgumentError, match="replica_status is not offered over a cluster target"):
        client.replica_status  # noqa: B018 - the attribute access is what is refused
    assert getattr(client, "no_such_call", None) is None
    with pytest.raises(UnavailableError, match="cannot read cluster c's directory"):
        asyncio.run(client.get_pool("p"))
    asyncio.run(client.close())
