"""Crash safety of a real daemon: fsync ``always``, steps driven over gRPC from
this process, SIGKILL at random moments (20+ times).

After every kill the data directory is recovered by an in-process engine and
must equal, exactly, a reference engine fed the acknowledged steps -- plus at
most the one step that was in flight when the kill landed (logged, but its
answer lost). Invariants must hold. Then the daemon restarts on the same
directory and the in-flight step is retried with its request id: the first
result comes back if it had landed, otherwise it applies now; either way the
daemon and the reference agree again.
"""

import json
import random
import threading

from blockd.core import Allocate, Append, BlockdError, Commit, Fork, Free, PoolConfig
from blockd.core.state import dump_pool
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from client.errors import BlockdClientError
from client.sdk import BlockdClient
from tests.support.procs import start_blockd

KILLS = 20


def state_of(engine: Engine) -> str:
    out = {}
    for stats in engine.list_pools():
        data = dump_pool(engine._state.pools[stats.name].pool)
        data.pop("deltas")  # a restart keeps them, but equality of tables is what matters here
        out[stats.name] = data
    return json.dumps(out, sort_keys=True)


class Workload:
    """A deterministic stream of batches over two pools, with forks and frees."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.live = {"p0": [], "p1": []}
        self.n = 0

    def next(self):
        self.n += 1
        pool = self.rng.choice(["p0", "p1"])
        live, ops = self.live[pool], []
        if live and self.rng.random() < 0.3:
            victim = live.pop(self.rng.randrange(len(live)))
            ops.append(Free(victim))
        name = f"s{self.n}"
        prompt = [self.rng.randrange(4)] * self.rng.randrange(1, 12)
        ops += [Allocate(name, prompt), Commit(name, len(prompt))]
        if live:
            target = self.rng.choice(live)
            ops.append(Append(target, [self.rng.randrange(50)] * self.rng.randrange(1, 4)))
            if self.rng.random() < 0.2:
                ops.append(Fork(target, f"{name}f"))
                live.append(f"{name}f")
        live.append(name)
        return pool, ops, f"req-{self.n}"


def apply_ref(ref: Engine, pool, ops, rid) -> bool:
    try:
        ref.step(pool, ops, rid)
        return True
    except BlockdError:
        return False


def test_sigkill_never_loses_an_acknowledged_step(tmp_path):
    data_dir = str(tmp_path / "data")
    rng = random.Random(7)
    ref = Engine()
    work = Workload(11)
    for name in ("p0", "p1"):
        ref.create_pool(PoolConfig(name, num_blocks=48, block_size=4), request_id=f"create-{name}")
    pending = None  # (pool, ops, rid) whose answer a kill may have swallowed
    created = False
    kills_in_flight = 0
    for kill in range(KILLS):
        proc = start_blockd("--data-dir", data_dir, "--fsync", "always", "--snapshot-every", "9")
        # a generous deadline: a loaded machine is slow, not wrong
        client = BlockdClient(proc.address, timeout_s=30, max_attempts=1)
        try:
            if not created:
                for name in ("p0", "p1"):
                    client.create_pool(PoolConfig(name, num_blocks=48, block_size=4), request_id=f"create-{name}")
                created = True
            if pending is not None:  # retry with the same id: first result, or applied now
                _send(client, *pending)
                pending = None
            timer = threading.Timer(rng.uniform(0.05, 0.6), proc.kill)
            timer.start()
            while proc.popen.poll() is None:
                batch = work.next()
                pending = batch
                ok_ref = apply_ref(ref, *batch)
                try:
                    accepted = _send(client, *batch)
                except BlockdClientError:
                    if proc.popen.poll() is None:
                        proc.popen.wait(5)
                    break  # killed mid-call: the batch stays pending
                assert accepted == ok_ref
                pending = None
            timer.cancel()
        finally:
            client.close()
            proc.kill()
        recovered = Engine(EngineConfig(data_dir=data_dir))
        try:
            recovered.check_invariants()
            got = state_of(recovered)
        finally:
            recovered.close()
        kills_in_flight += pending is not None
        if pending is None:
            assert got == state_of(ref), f"kill {kill}: state differs from the acknowledged steps"
        else:
            # the in-flight batch is either wholly there or wholly absent
            without = _without_last(ref, work)
            assert got in (state_of(ref), without), f"kill {kill}: a batch was half-applied or lost"
    assert work.n > KILLS
    assert kills_in_flight, "no kill landed while a step was in flight: the test proved nothing"


def _send(client: BlockdClient, pool, ops, rid) -> bool:
    try:
        client.step(pool, ops, request_id=rid)
        return True
    except BlockdClientError as err:
        if err.code is not None and err.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED",
                                                        "UNKNOWN", "INTERNAL"):
            raise
        return False


def _without_last(ref: Engine, work: Workload) -> str:
    """The reference state before its last batch: rebuilt by replay (cheap here)."""
    replay = Engine()
    for name in ("p0", "p1"):
        replay.create_pool(PoolConfig(name, num_blocks=48, block_size=4), request_id=f"create-{name}")
    again = Workload(11)
    for _ in range(work.n - 1):
        apply_ref(replay, *again.next())
    return state_of(replay)
