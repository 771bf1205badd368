"""The idempotency table: content fingerprints, the count/byte/age bounds, the
compact answers, and a table that replay rebuilds exactly."""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockd.core import (
    Allocate,
    AlreadyExists,
    Append,
    Commit,
    ExtraKeys,
    Fork,
    Free,
    InvalidArgument,
    PoolConfig,
    WrongState,
)
from blockd.core.state import op_to_json
from blockd.core.types import OFFLOAD, RESTORE, DecodeAppend, OpResult, PoolStats, StepResult, TierOp
from blockd.engine.config import EngineConfig
from blockd.engine.idempotency import IdempotencyLimits, IdempotencyTable
from blockd.engine.idempotency_codec import decode_result, encode_result, fingerprint
from blockd.engine.machine import Engine
from client import errors as ce

pytest_plugins = ["tests.support.grpc_fixtures"]


class Clock:
    """Wall-clock seconds the test moves by hand."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def small_engine(limits: IdempotencyLimits | None = None, clock: Clock | None = None, **kwargs) -> Engine:
    engine = Engine(EngineConfig(idempotency=limits or IdempotencyLimits(), wall_clock=clock or Clock(), **kwargs))
    engine.create_pool(PoolConfig("p", num_blocks=4096, block_size=4), request_id="create-p")
    return engine


# --- fingerprints -----------------------------------------------------------------------------
def test_reused_request_id_with_different_content_is_invalid_argument():
    engine = small_engine()
    engine.create_pool(PoolConfig("q", num_blocks=8, block_size=4))
    first = engine.step("p", [Allocate("a", [1, 2, 3])], "r1")
    # the same request (tuples instead of lists) is a retry: the first answer, nothing changes
    assert engine.step("p", (Allocate("a", (1, 2, 3)),), "r1") == first
    for other in ([Allocate("a", [1, 2, 4])], [Allocate("b", [1, 2, 3])],
                  [Allocate("a", [1, 2, 3]), Commit("a", 3)], [Allocate("a", [1, 2, 3], ExtraKeys(model_id="m"))]):
        with pytest.raises(InvalidArgument, match="'r1' was already used for a step on pool 'p' with different"):
            engine.step("p", other, "r1")
    with pytest.raises(InvalidArgument, match="already used for a step on pool 'p'; use a fresh id"):
        engine.step("q", [Allocate("a", [1, 2, 3])], "r1")
    with pytest.raises(InvalidArgument, match="already used for a step"):
        engine.reset_prefix_cache("p", request_id="r1")
    assert engine.get_pool("p").version == first.version and engine.get_pool("p").num_seqs == 1
    assert engine.get_pool("q").num_seqs == 0


def test_reused_request_id_with_different_ops_over_grpc(client) -> None:
    client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
    first = client.step("p", [Allocate("a", [1, 2, 3])], request_id="step-1")
    assert client.step("p", [Allocate("a", [1, 2, 3])], request_id="step-1") == first
    with pytest.raises(ce.InvalidArgumentError, match="different content"):
        client.step("p", [Append("a", [4])], request_id="step-1")
    assert client.get_tables("p") == (first.version, {"a": list(first.results[0].new_block_ids)})


ids = st.sampled_from(["a", "b", "", "a\0b", "\0", "\u00e9", "ab"])
token_lists = st.lists(st.sampled_from([0, 1, 7, 2**32 - 1, 2**32, -1]), max_size=4)
ops = st.lists(st.one_of(
    st.builds(Allocate, ids, token_lists, st.builds(ExtraKeys, model_id=st.sampled_from(["", "m"])),
              share_seq_id=st.sampled_from(["", "", "a", "b"]), share_tokens=st.sampled_from([0, 4])),
    st.builds(Append, ids, token_lists),
    st.builds(DecodeAppend, st.lists(ids, max_size=3), token_lists),
    st.builds(Commit, ids, st.sampled_from([0, 3, 2**64])),
    st.builds(Fork, ids, ids),
    st.builds(Free, ids),
), max_size=3)


@settings(max_examples=300, deadline=None)
@given(a=ops, b=ops)
def test_fingerprint_is_equal_exactly_for_equal_requests(a, b):
    """Injective on content (NULs in ids, token ids the core refuses, empty
    lists included), blind to list vs tuple."""
    same = [op_to_json(o) for o in a] == [op_to_json(o) for o in b]
    assert (fingerprint("step", "p", a) == fingerprint("step", "p", b)) == same
    assert fingerprint("step", "p", tuple(a)) == fingerprint("step", "p", a)
    assert fingerprint("step", "p", a) != fingerprint("step", "q", a)


# --- compact answers --------------------------------------------------------------------------
u64 = st.integers(0, 2**64 - 1)
runs = st.tuples(st.integers(0, 2**40), st.integers(0, 40)).map(lambda r: tuple(range(r[0], r[0] + r[1])))
int_tuples = st.one_of(runs, st.lists(st.one_of(st.integers(0, 50), u64), max_size=8).map(tuple))
pairs = st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=3).map(tuple)
op_results = st.builds(OpResult, st.text(max_size=5), u64, u64, runs.filter(lambda t: not t or t[-1] < 2**32),
                       pairs, u64, int_tuples)
answers = st.one_of(st.none(), st.builds(StepResult, u64, st.lists(op_results, max_size=3).map(tuple), pairs),
                    st.builds(PoolStats, *([st.text(max_size=4)] + [st.integers(0, 2**40)] * 15)))


@st.composite
def table_result(draw) -> tuple[int, OpResult]:
    """(block size, result) whose slots run through a block table, sometimes
    with one slot off (the block form must notice), and whose new blocks are
    those of the slots, all but the first, or others."""
    b = draw(st.sampled_from([2, 4, 16]))
    table = draw(st.lists(st.integers(0, 2**20), min_size=1, max_size=6))
    start = draw(st.integers(0, len(table) * b - 1))
    end = draw(st.integers(start, len(table) * b))
    slots = [table[p // b] * b + p % b for p in range(start, end)]
    covering = tuple(table[start // b : -(-end // b)])
    new = draw(st.sampled_from([(), covering, covering[1:], covering[:1], tuple(reversed(covering))]))
    if slots and draw(st.booleans()):
        slots[draw(st.integers(0, len(slots) - 1))] += draw(st.sampled_from([1, b, 2**33]))
    return b, OpResult("s", 9, 0, new, (), start, tuple(slots))


@given(answer=answers, block_size=st.sampled_from([0, 1, 4, 16]), table=table_result())
def test_answers_survive_their_compact_form(answer, block_size, table):
    assert decode_result(encode_result(answer, block_size)) == answer
    b, result = table
    step = StepResult(7, (result,))
    assert decode_result(encode_result(step, b)) == step


tier_ops = st.lists(st.builds(TierOp, st.sampled_from([OFFLOAD, RESTORE]), st.integers(0, 2**32 - 1),
                              st.integers(0, 2**32 - 1)), max_size=4).map(tuple)


@given(step=st.builds(StepResult, u64, st.lists(op_results, max_size=3).map(tuple), pairs,
                      st.sampled_from(["", "0123456789abcdef0123456789abcdef", "other"]), st.just(0), tier_ops),
       restored=st.lists(st.integers(0, 2**32 - 1), max_size=3))
def test_a_step_keeps_its_tier_ops_and_restored_tokens(step, restored):
    """A retried request id must get the host-tier ops its workers run and the
    restored tokens its scheduler must not compute, not an answer without them."""
    results = tuple(replace(r, num_restored_tokens=n) for r, n in zip(step.results, restored + [0] * 3))
    step = replace(step, results=results)
    assert decode_result(encode_result(step, 4)) == step


def test_a_retried_step_answers_with_its_restores():
    engine = Engine()
    engine.create_pool(PoolConfig("t", num_blocks=4, block_size=2, num_host_blocks=8))
    engine.step("t", [Allocate("a", [1, 2, 3, 4, 5]), Commit("a", 5)])
    engine.step("t", [Free("a"), Allocate("b", [9, 8, 7, 6, 5])])  # b's blocks push a cached one to the host
    first = engine.step("t", [Free("b"), Allocate("c", [1, 2, 3, 4, 6])], "rid-restore")
    restores = [op for op in first.tier_ops if op.kind == RESTORE]
    assert restores and first.results[1].num_restored_tokens == 2 * len(restores)
    assert engine.step("t", [Free("b"), Allocate("c", [1, 2, 3, 4, 6])], "rid-restore") == first


def test_answers_are_compact():
    engine = small_engine()
    engine.step("p", [Allocate(f"s{i}", [i] * 4) for i in range(256)])
    prefill = engine.step("p", [Allocate("long", list(range(2048)))], "prefill")
    decode = engine.step("p", [DecodeAppend([f"s{i}" for i in range(256)], [7] * 256)], "decode")
    assert len(encode_result(prefill, 4)) < 128  # slots through one run of blocks, ~8 bytes of missed tokens
    assert len(encode_result(decode, 4)) < 256 * 4 + 120  # 256 slots as u32, the 256 new blocks as one run
    # freed tail first, a sequence's blocks come back in reverse: the slots are
    # still kept as their blocks, the blocks as one run down
    engine.create_pool(PoolConfig("full", num_blocks=512, block_size=4))
    engine.step("full", [Allocate("long", list(range(2048)))])  # every fresh block is used
    engine.step("full", [Free("long")])
    again = engine.step("full", [Allocate("again", list(range(5000, 7048)))], "again")
    assert list(again.results[0].new_block_ids) == sorted(again.results[0].new_block_ids, reverse=True)
    assert len(encode_result(again, 4)) < 128
    assert decode_result(encode_result(again, 4)) == again


# --- bounds -----------------------------------------------------------------------------------
def decode_steps(engine: Engine, count: int, width: int = 64, prefix: str = "d") -> list[StepResult]:
    """``count`` decode steps of ``width`` sequences (answers of ~4 bytes a sequence)."""
    seqs = [f"{prefix}{i}" for i in range(width)]
    engine.step("p", [Allocate(s, [1, 2, 3, 4]) for s in seqs])
    return [engine.step("p", [DecodeAppend(seqs, [n % 50] * width)], f"{prefix}-r{n}") for n in range(count)]


def test_table_stays_under_its_byte_cap_and_drops_oldest_answers_first():
    limits = IdempotencyLimits(max_entries=1000, max_bytes=96 * 1024, ttl_s=3600)
    engine = small_engine(limits)
    seqs = [f"d{i}" for i in range(64)]
    engine.step("p", [Allocate(s, [1, 2, 3, 4]) for s in seqs])
    results = []
    for n in range(200):
        results.append(engine.step("p", [DecodeAppend(seqs, [n % 50] * 64)], f"r{n}"))
        assert engine.idempotency_usage().num_bytes <= limits.max_bytes
    usage = engine.idempotency_usage()
    assert usage.num_ids == 201 and 10 < usage.num_answers < 150
    kept = [answer is not None for _, _, _, answer, *_ in engine._state.requests.dump()["entries"]]
    assert kept == [False] * (201 - usage.num_answers) + [True] * usage.num_answers  # the newest answers
    version = engine.get_pool("p").version
    # the newest ids still get their first answer
    assert engine.step("p", [DecodeAppend(seqs, [199 % 50] * 64)], "r199") == results[199]
    # the oldest were applied but lost their answer: refused, never applied twice
    with pytest.raises(WrongState, match=r"'r0' was applied .* answer is no longer kept"):
        engine.step("p", [DecodeAppend(seqs, [0] * 64)], "r0")
    # a different request under a dropped answer's id is still caught
    with pytest.raises(InvalidArgument, match="different content"):
        engine.step("p", [DecodeAppend(seqs, [1] * 64)], "r0")
    assert engine.get_pool("p").version == version


def test_count_cap_forgets_the_oldest_ids():
    engine = small_engine(IdempotencyLimits(max_entries=10))
    decode_steps(engine, 30)
    usage = engine.idempotency_usage()
    assert usage.num_ids == usage.num_answers == 10
    assert [rid for rid, *_ in engine._state.requests.dump()["entries"]] == [f"d-r{n}" for n in range(20, 30)]


def test_ids_older_than_the_ttl_are_forgotten():
    clock = Clock()
    engine = small_engine(IdempotencyLimits(ttl_s=60), clock)
    first = engine.step("p", [Allocate("a", [1])], "r1")
    clock.t += 30
    second = engine.step("p", [Allocate("b", [1])], "r2")
    clock.t += 31  # r1 is 61 s old, r2 31 s
    assert engine.step("p", [Allocate("b", [1])], "r2") == second
    # r1 is forgotten: the retry is a new request (here it fails: "a" exists)
    with pytest.raises(AlreadyExists):
        engine.step("p", [Allocate("a", [1])], "r1")
    engine.step("p", [Free("a")], "r3")  # the next record drops what its time says is too old
    assert [rid for rid, *_ in engine._state.requests.dump()["entries"]] == ["r2", "r3"]
    assert first.version < second.version


def test_a_clock_going_back_never_makes_record_times_go_back():
    clock = Clock()
    engine = small_engine(IdempotencyLimits(ttl_s=60), clock)
    engine.step("p", [Allocate("a", [1])], "r1")
    clock.t -= 3600  # the wall clock was set back an hour
    engine.step("p", [Allocate("b", [1])], "r2")
    times = [t for _, _, t, *_ in engine._state.requests.dump()["entries"]]
    assert times == sorted(times) and len(times) == 3  # create-p, r1, r2


def test_estimated_bytes_cover_the_real_memory():
    """The byte estimate is what the cap bounds: it must not undercount what
    the entries really hold (tracemalloc counts every allocation they make)."""
    engine = small_engine()
    answers = decode_steps(engine, 50)
    table = IdempotencyTable(IdempotencyLimits(max_entries=100_000, max_bytes=1 << 40))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(5000):
            rid = f"{n:032x}"  # the id strings are held by the table, as from a request
            table.put(rid, fingerprint("step", "p", [DecodeAppend(["a"], [n])]), 1.0, answers[n % 50])
        real = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimate = table.usage().num_bytes
    assert real <= estimate <= 1.5 * real


def test_limits_are_checked():
    for bad in ({"max_entries": 0}, {"max_bytes": -1}, {"ttl_s": 0}, {"max_entries": 1.5}):
        with pytest.raises(ValueError, match="must be a positive"):
            IdempotencyLimits(**bad)


def test_serve_flags_and_env(monkeypatch, capsys):
    from blockd import cli, config_env

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--max-request-ids", "0"])
    assert exc.value.code == 2
    assert "argument --max-request-ids: must be an integer >= 1" in capsys.readouterr().err
    monkeypatch.setenv("BLOCKD_MAX_REQUEST_BYTES", "lots")
    with pytest.raises(SystemExit):
        config_env.parse_args(cli.build_parser(), ["serve"], "BLOCKD_")
    assert "BLOCKD_MAX_REQUEST_BYTES must be an integer >= 1, got 'lots'" in capsys.readouterr().err
    monkeypatch.setenv("BLOCKD_MAX_REQUEST_BYTES", "4096")
    monkeypatch.setenv("BLOCKD_REQUEST_TTL_S", "2.5")
    args = config_env.parse_args(cli.build_parser(), ["serve"], "BLOCKD_")
    assert (args.max_request_ids, args.max_request_bytes, args.request_ttl_s) == (16384, 4096, 2.5)
