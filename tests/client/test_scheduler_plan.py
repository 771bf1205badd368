"""The scheduler's pure parts, by tables of cases, without blockd or a model:
:func:`client.step_plan.plan_step` (the state -> the step's batch) and the
functions of :mod:`client.faults` (a refusal or fault and the state -> the
:class:`~client.faults.Recovery` the scheduler carries out).

A plan is compared through :func:`summary`: its ops written out
(``"Allocate w.0 6"``: sequence ``w.0`` with a 6-token prompt), the
sequences it decodes, the prefill chunks, the admitted requests with each
Allocate's op index and first chunk, and the rejected requests.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace

import grpc
import pytest
from google.rpc import error_details_pb2

from blockd.core.types import Allocate, Commit, DecodeAppend, Fork, Free, Op
from client.errors import (
    BlockdClientError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from client.faults import Recovery, on_kv_lost, on_model_fault, on_no_room, on_pool_gone, on_term_changed
from client.scheduler_config import SchedulerConfig
from client.serving import GenerationRequest, PagingAdmission, RequestState, ReservationAdmission
from client.step_plan import StepPlan, plan_step

CONFIG = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)


# --- states ------------------------------------------------------------------------
def waiting(rid: str, prompt_len: int = 0, *, n: int = 1, tokens: tuple[int, ...] = ()) -> RequestState:
    """A request just queued: ``tokens``, or ``prompt_len`` tokens of its own."""
    prompt = tokens or tuple(range(100 * (ord(rid[0]) + 1), 100 * (ord(rid[0]) + 1) + prompt_len))
    return RequestState(GenerationRequest(rid, prompt, max_new_tokens=8, n=n), arrival_s=0.0)


def prefilling(rid: str, prompt_len: int = 0, *, computed: int, committed: int = 0,
               tokens: tuple[int, ...] = ()) -> RequestState:
    """A running request whose prompt is allocated and computed up to ``computed``."""
    state = waiting(rid, prompt_len, tokens=tokens)
    seq = state.samples[0]
    seq.num_in_pool, seq.num_computed, seq.num_committed = len(seq.token_ids), computed, committed
    seq.slots = tuple(range(len(seq.token_ids)))
    return state


def decoding(rid: str, prompt_len: int) -> RequestState:
    """A running request that has drawn one token and appends it next."""
    state = prefilling(rid, prompt_len, computed=prompt_len, committed=prompt_len)
    state.add_token(state.samples[0], 7)
    return state


def preempted(rid: str, prompt_len: int, n: int) -> RequestState:
    """A request preempted after its ``n`` samples drew their first tokens, before the fork."""
    state = drew(rid, prompt_len, n)
    state.release_pending()
    for seq in state.samples:
        seq.evict()
    return state


def drew(rid: str, prompt_len: int, n: int) -> RequestState:
    """A running request whose prompt ended: its ``n`` samples drew their first tokens, 1.. wait for the fork."""
    state = prefilling(rid, prompt_len, computed=prompt_len, committed=prompt_len)
    state.draw_samples(state.samples[0], list(range(7, 7 + n)))
    return state


# --- plans ---------------------------------------------------------------------------
def describe(op: Op) -> str:
    if isinstance(op, Allocate):
        shared = f" sharing {op.share_tokens} of {op.share_seq_id}" if op.share_seq_id else ""
        return f"Allocate {op.seq_id} {len(op.prompt_token_ids)}{shared}"
    if isinstance(op, DecodeAppend):
        return "DecodeAppend " + " ".join(op.seq_ids)
    if isinstance(op, Commit):
        return f"Commit {op.seq_id} {op.num_tokens}"
    if isinstance(op, Fork):
        return f"Fork {op.parent_seq_id} {op.child_seq_id}"
    if isinstance(op, Free):
        return f"Free {op.seq_id}"
    raise AssertionError(f"the scheduler plans no {op!r}")


def summary(plan: StepPlan) -> dict:
    return {
        "ops": [describe(op) for op in plan.ops],
        "decode": [seq.seq_id for seq in plan.decode],
        "prefill": [(seq.seq_id, chunk) for seq, chunk in plan.prefill],
        "admitted": {state.request.request_id: allocations for state, allocations in plan.admitted},
        "rejected": [(state.request.request_id, why) for state, why in plan.rejected],
    }


@dataclass
class Case:
    name: str
    running: list[RequestState] = field(default_factory=list)
    waiting: list[RequestState] = field(default_factory=list)
    releases: list[Op] = field(default_factory=list)
    config: SchedulerConfig = CONFIG
    admission: PagingAdmission | ReservationAdmission = field(default_factory=PagingAdmission)
    admission_blocked: bool = False
    admit_limit: int | None = None
    # the plan expected
    ops: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill: list[tuple[str, int]] = field(default_factory=list)
    admitted: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    rejected: list[tuple[str, str]] = field(default_factory=list)

    def plan(self) -> StepPlan:
        return plan_step(self.config, self.admission, running=self.running, waiting=self.waiting,
                         releases=self.releases, admission_blocked=self.admission_blocked,
                         admit_limit=self.admit_limit)


SHARED = tuple(range(1, 9))  # two full blocks of 4 tokens
PREFIX = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, prefix_block_size=4)

CASES = [
    Case("nothing to do"),
    Case("a waiting request is allocated, its whole prompt the first chunk",
         waiting=[waiting("w", 6)], ops=["Allocate w.0 6"], admitted={"w": [(0, 6)]}),
    Case("a prompt longer than the budget is admitted with the budget as its first chunk",
         waiting=[waiting("w", 40)], ops=["Allocate w.0 40"], admitted={"w": [(0, 16)]}),
    Case("admission stops where the budget is spent",
         waiting=[waiting("a", 10), waiting("b", 10), waiting("c", 1)],
         ops=["Allocate a.0 10", "Allocate b.0 10"], admitted={"a": [(0, 10)], "b": [(1, 6)]}),
    Case("FCFS: a request beyond max_num_seqs stops admission, though one behind it would fit",
         waiting=[waiting("a", 2, n=3), waiting("b", 2, n=2), waiting("c", 2)],
         ops=["Allocate a.0 2"], admitted={"a": [(0, 2)]}),
    Case("decoding sequences append their last token, one token of the budget each",
         running=[decoding("a", 5), decoding("b", 3)], waiting=[waiting("w", 20)],
         ops=["DecodeAppend a.0 b.0", "Allocate w.0 20"], decode=["a.0", "b.0"], admitted={"w": [(1, 14)]}),
    Case("a prefill commits what the last step computed, then takes its next chunk",
         running=[prefilling("p", 30, computed=16)], waiting=[waiting("w", 4)],
         ops=["Commit p.0 16", "Allocate w.0 4"], prefill=[("p.0", 14)], admitted={"w": [(1, 2)]}),
    Case("a prefill with nothing new computed commits nothing",
         running=[prefilling("p", 30, computed=16, committed=16)], ops=[], prefill=[("p.0", 14)]),
    Case("samples fork from sample 0 before the releases, and decode beside it",
         running=[drew("s", 5, n=3)], releases=[Commit("x.0", 7), Free("x.0")],
         ops=["Fork s.0 s.1", "Fork s.0 s.2", "Commit x.0 7", "Free x.0", "DecodeAppend s.0 s.1 s.2"],
         decode=["s.0", "s.1", "s.2"]),
    Case("a refused admission admits nothing until a Free is sent",
         waiting=[waiting("w", 4)], admission_blocked=True),
    Case("a refused Allocate admits only the requests before it",
         waiting=[waiting("a", 2), waiting("b", 2)], admit_limit=1,
         ops=["Allocate a.0 2"], admitted={"a": [(0, 2)]}),
    Case("a waiting request of n samples is allocated once: its samples fork when its prompt ends",
         waiting=[waiting("m", 3, n=2)], ops=["Allocate m.0 3"], admitted={"m": [(0, 3)]}),
    Case("each sample of a request preempted before the fork is allocated on its own",
         waiting=[preempted("m", 3, n=2)], ops=["Allocate m.0 4", "Allocate m.1 4"],
         admitted={"m": [(0, 4), (1, 4)]}),
    Case("nothing running: a request beyond max_num_seqs can never start, the next is admitted",
         waiting=[waiting("big", 3, n=5), waiting("w", 3)], ops=["Allocate w.0 3"], admitted={"w": [(0, 3)]},
         rejected=[("big", "its 5 sequences exceed max_num_seqs")]),
    Case("something running: a request beyond max_num_seqs waits, it is not rejected",
         running=[decoding("a", 3)], waiting=[waiting("big", 3, n=5)], ops=["DecodeAppend a.0"], decode=["a.0"]),
    Case("max_reservation stops admission at the first request whose reservation does not fit",
         config=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
         admission=ReservationAdmission(num_blocks=8, block_size=4, max_len=8),
         waiting=[waiting("a", 2, n=3), waiting("b", 2), waiting("c", 2)],
         ops=["Allocate a.0 2", "Allocate b.0 2"], admitted={"a": [(0, 2)], "b": [(1, 2)]}),
    Case("nothing running: a request max_reservation can never hold is rejected",
         admission=ReservationAdmission(num_blocks=4, block_size=4, max_len=8),
         waiting=[waiting("a", 2, n=3), waiting("b", 2)], ops=["Allocate b.0 2"], admitted={"b": [(0, 2)]},
         rejected=[("a", "the max_reservation admission policy can never admit it")]),
    Case("prefix sharing: a prompt sharing blocks an admission computes in this step is admitted beside it "
         "and takes them from it",
         config=PREFIX, waiting=[waiting("a", tokens=(*SHARED, 50)), waiting("b", tokens=(*SHARED, 60)),
                                 waiting("c", 3)],
         ops=["Allocate a.0 9", "Allocate b.0 9 sharing 8 of a.0"], admitted={"a": [(0, 9)], "b": [(1, 7)]}),
    Case("prefix sharing: each prompt takes its deepest shared block's computing admission",
         config=replace(PREFIX, max_num_batched_tokens=64),
         waiting=[waiting("a", tokens=(*SHARED[:4], 50)), waiting("b", tokens=(*SHARED, 60)),
                  waiting("c", tokens=(*SHARED, 70)), waiting("d", tokens=(*SHARED[:4], 80, 81, 82, 83, 84))],
         ops=["Allocate a.0 5", "Allocate b.0 9 sharing 4 of a.0", "Allocate c.0 9 sharing 8 of b.0",
              "Allocate d.0 9 sharing 4 of a.0"],
         admitted={"a": [(0, 5)], "b": [(1, 9)], "c": [(2, 9)], "d": [(3, 9)]}),
    Case("prefix sharing: a prompt sharing a block past an admission's chunk waits for its commit, FCFS",
         config=PREFIX, waiting=[waiting("a", tokens=(*range(1, 21), 99)), waiting("b", tokens=(*range(1, 21), 77)),
                                 waiting("c", 3)],
         ops=["Allocate a.0 21"], admitted={"a": [(0, 16)]}),
    Case("prefix sharing: a prompt sharing a block a running prefill has not computed waits",
         config=PREFIX, running=[prefilling("p", tokens=(*SHARED, 9, 10), computed=4)],
         waiting=[waiting("b", tokens=(*SHARED, 70))],
         ops=["Commit p.0 4"], prefill=[("p.0", 6)]),
    Case("prefix sharing: a prompt whose shared blocks this batch commits is admitted",
         config=PREFIX, running=[prefilling("p", tokens=(*SHARED, 9, 10), computed=8)],
         waiting=[waiting("b", tokens=(*SHARED, 70))],
         ops=["Commit p.0 8", "Allocate b.0 9"], prefill=[("p.0", 2)], admitted={"b": [(1, 9)]}),
    Case("prefix sharing off: prompts sharing blocks are admitted together",
         waiting=[waiting("a", tokens=(*SHARED, 50)), waiting("b", tokens=(*SHARED, 60))],
         ops=["Allocate a.0 9", "Allocate b.0 9"], admitted={"a": [(0, 9)], "b": [(1, 7)]}),
]


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name) for case in CASES])
def test_plan(case: Case):
    expected = {"ops": case.ops, "decode": case.decode, "prefill": case.prefill, "admitted": case.admitted,
                "rejected": case.rejected}
    assert summary(case.plan()) == expected


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name) for case in CASES])
def test_planning_changes_nothing_and_plans_the_same_again(case: Case):
    before = copy.deepcopy((case.running, case.waiting, case.releases))
    first = summary(case.plan())
    assert (case.running, case.waiting, case.releases) == before
    assert summary(case.plan()) == first


def test_plan_points_at_the_ops_it_stands_for():
    plan = Case("", running=[decoding("a", 5)], waiting=[waiting("m", 3), waiting("w", 2)],
                releases=[Free("x.0")]).plan()
    assert plan.has_frees
    assert isinstance(plan.ops[plan.decode_op], DecodeAppend)
    assert plan.admit_at == {2: 0, 3: 1}  # Allocate op index -> admitted position


# --- faults ----------------------------------------------------------------------------
def error(cls: type[BlockdClientError], reason: str = "", **metadata: object) -> BlockdClientError:
    info = error_details_pb2.ErrorInfo(reason=reason, metadata={key: str(value) for key, value in metadata.items()})
    return cls("refused", details=(info,))


def lost(*seq_ids: str) -> BlockdClientError:
    return error(FailedPreconditionError, "KV_LOST", seq_ids=json.dumps(seq_ids))


A, B = decoding("a", 3), decoding("b", 3)
W1, W2 = waiting("w", 2), waiting("v", 2)
ADMITTING = Case("", running=[A, B], waiting=[W1, W2]).plan()  # DecodeAppend a.0 b.0, Allocate w.0, Allocate v.0
ALONE = Case("", waiting=[W1, W2]).plan()  # Allocate w.0, Allocate v.0
NEVER_FITS = "needs more blocks than the pool can give one request (refused)"


@pytest.mark.parametrize(("plan", "running", "op_index", "expected"), [
    pytest.param(ALONE, [], 0, Recovery("no_room", reject=(W1, NEVER_FITS)),
                 id="the first Allocate refused with nothing running: the pool never holds it, fail it"),
    pytest.param(ALONE, [], 1, Recovery("no_room", admit_limit=1, admission_refused=True),
                 id="a later Allocate refused: admit the requests before it"),
    pytest.param(ADMITTING, [A, B], 1, Recovery("no_room", admit_limit=0, admission_refused=True),
                 id="the first Allocate refused while requests run: admit none until a Free"),
    pytest.param(ADMITTING, [A, B], 0, Recovery("no_room", preempt=(B,), keep_kv=True, admit_limit=0),
                 id="an append refused: preempt the newest running request, keeping its KV"),
])
def test_no_room(plan: StepPlan, running: list[RequestState], op_index: int, expected: Recovery):
    err = error(ResourceExhaustedError, "NO_ROOM", op_index=op_index)
    assert on_no_room(err, plan, running) == expected


@pytest.mark.parametrize(("plan", "metadata"), [
    pytest.param(ADMITTING, {}, id="no operation named"),
    pytest.param(ALONE, {"op_index": 5}, id="an append refused with nothing running"),
])
def test_no_room_the_scheduler_cannot_explain_is_raised(plan: StepPlan, metadata: dict):
    err = error(ResourceExhaustedError, "NO_ROOM", **metadata)
    with pytest.raises(ResourceExhaustedError) as raised:
        on_no_room(err, plan, [])
    assert raised.value is err


@pytest.mark.parametrize(("seq_ids", "releases", "expected"), [
    pytest.param(["b.0"], [], Recovery("kv_lost", releases=(), preempt=(B,)),
                 id="a running sequence: recompute its request"),
    pytest.param(["a.0", "b.0"], [Free("x.0")], Recovery("kv_lost", releases=(Free("x.0"),), preempt=(B, A)),
                 id="two requests: the newest preempted first, so the oldest ends first in the queue"),
    pytest.param(["x.0"], [Commit("x.0", 5), Free("x.0"), Commit("y.0", 3), Free("y.0")],
                 Recovery("kv_lost", releases=(Free("x.0"), Commit("y.0", 3), Free("y.0"))),
                 id="a finished sequence: only freed, its Commit would be refused"),
])
def test_kv_lost(seq_ids: list[str], releases: list[Op], expected: Recovery):
    assert on_kv_lost(lost(*seq_ids), [A, B], releases) == expected


def test_kv_lost_naming_nothing_held_is_raised():
    err = lost("z.0")
    with pytest.raises(FailedPreconditionError) as raised:
        on_kv_lost(err, [A, B], [Free("x.0")])
    assert raised.value is err


def test_term_changed_recomputes_everything_and_resends_the_frees_a_failover_may_have_lost():
    pair = drew("p", 3, n=2)
    running = [pair, decoding("q", 3)]
    (forked,) = pair.pending
    pair.samples.append(forked)  # forked in a step the new leader lost
    pair.pending = []
    releases: list[Op] = [Commit("f.0", 5), Free("f.0"), Free("g.0")]
    recent_frees = [["h.0", "k.0"], ["f.0"], ["q.0"]]
    tables = {"p.0": [1], "q.0": [2], "f.0": [3], "h.0": [4], "k.0": [5]}
    err = error(FailedPreconditionError, "TERM_CHANGED", term=7)
    recovery = on_term_changed(err, running, releases, recent_frees, tables)
    assert recovery == Recovery(
        "term_changed", lost=(forked,),
        # f.0's Commit may name tokens the new leader lacks; g.0 it no longer holds; h.0 and k.0 it
        # may hold still (freed in the old term); q.0 runs, so its own recompute frees it
        releases=(Free("f.0"), Free("h.0"), Free("k.0")), term=7, preempt=tuple(reversed(running)))


@pytest.mark.parametrize(("err", "reset_prefix_cache"), [
    pytest.param(error(FailedPreconditionError, "KV_NOT_WRITTEN"), True,
                 id="KV not written: blockd may cache blocks the worker lost, drop them"),
    pytest.param(error(FailedPreconditionError, "WORKER_INCARNATION_MISMATCH"), False, id="a worker restarted"),
    pytest.param(error(FailedPreconditionError, "TERM_NOT_SEEN"), False, id="a worker behind the new term"),
    pytest.param(UnavailableError("gone"), False, id="a worker unreachable"),
    pytest.param(BlockdClientError("slow", code=grpc.StatusCode.DEADLINE_EXCEEDED), False, id="a worker too slow"),
])
def test_worker_fault_recomputes_the_batch_and_waits_for_the_workers(err: BlockdClientError,
                                                                     reset_prefix_cache: bool):
    finished = decoding("c", 3)  # in the batch, but no longer running: nothing to recompute
    recovery = on_model_fault("m", err, [A, B, A, finished], [A, B])
    assert recovery == Recovery("worker_fault", preempt=(B, A), reset_prefix_cache=reset_prefix_cache,
                                reconnect_workers=True)


def test_model_step_on_a_re_created_pool_fails_everything():
    err = error(FailedPreconditionError, "POOL_INCARNATION_MISMATCH")
    assert on_model_fault("m", err, [A], [A]) == on_pool_gone("m", err)
    assert on_pool_gone("m", err) == Recovery("pool_gone", fail_all=(
        "pool 'm' was deleted or re-created while this request ran, so its sequences are gone: refused"))


@pytest.mark.parametrize("err", [
    pytest.param(InvalidArgumentError("bad batch"), id="a bad batch"),
    pytest.param(error(FailedPreconditionError, "SOMETHING_ELSE"), id="another precondition"),
])
def test_model_fault_that_is_not_a_worker_fault_is_raised(err: BlockdClientError):
    with pytest.raises(BlockdClientError) as raised:
        on_model_fault("m", err, [A], [A])
    assert raised.value is err


def test_a_requests_priority_is_its_allocations_and_out_of_range_is_refused() -> None:
    low = RequestState(GenerationRequest("w", (1, 2, 3), max_new_tokens=8, n=2, priority=0), arrival_s=0.0)
    plan = plan_step(CONFIG, PagingAdmission(), running=[], waiting=[low, waiting("d", 3)], releases=[])
    # the second sample is forked from the first later, and a fork inherits its parent's priority
    assert [(op.seq_id, op.priority) for op in plan.ops if isinstance(op, Allocate)] == [("w.0", 0), ("d.0", 4)]
    for bad in (8, -1, True, "1"):
        with pytest.raises(ValueError, match="priority must be an integer in"):
            GenerationRequest("x", (1,), max_new_tokens=1, priority=bad)
