"""How a :class:`client.scheduler.Scheduler` is configured, and what it counts.

The small shared types of the scheduler's parts: the planner
(:mod:`client.step_plan`) reads :class:`SchedulerConfig`, the scheduler
(:mod:`client.scheduler`) fills :class:`SchedulerCounters`. Both are plain
data; this module imports nothing from ``client``, so every part of the
scheduler imports it downward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    #: tokens one model step computes at most: decode tokens + prompt chunks. The
    #: defaults are vLLM's for its offline engine on a CPU (4096 and 256), what the
    #: benchmarks against vLLM measure blockd with: a user gets the same speed unasked
    max_num_batched_tokens: int = 4096
    #: sequences running at once at most (forked samples count)
    max_num_seqs: int = 256
    #: how long to wait for unreachable or restarted workers before giving up
    worker_restart_timeout_s: float = 120.0
    #: the model's end-of-sequence tokens (its generation config's eos_token_id):
    #: a sample that draws one ends, unless its request ignores EOS
    eos_token_ids: tuple[int, ...] = ()
    #: the pool's block size, to share prompt prefixes within a burst of requests: a
    #: waiting request whose prompt has full blocks in common with a prompt admitted
    #: in the same step, within that prompt's chunk, is admitted beside it and takes
    #: them from that prompt (``Allocate.share_seq_id``; the worker writes each
    #: layer's new K/V before its attention reads any), as vLLM shares blocks
    #: within a step. One sharing a block that no step computes yet (a later chunk of
    #: a long prompt) is admitted once that block is committed; admission stays FCFS,
    #: so the requests behind it wait too. 0: off (every prompt computes its own).
    #: None (the default): the pool's block size, which the scheduler asks blockd
    #: for before its first step (off when its backend cannot say), so a user gets
    #: what the benchmarks use.
    prefix_block_size: int | None = None
    #: another pool of the tenant (same model geometry) whose cached prefixes this
    #: scheduler's admissions may fetch instead of computing (``Allocate.source_pool``;
    #: the executor's workers fetch them, :meth:`client.model_group.WorkerGroup.fetch_blocks`).
    #: "": none
    source_pool: str = ""
    #: steps go over one ``StepStream`` (when the backend has ``step_stream``): the same
    #: answers as unary ``Step`` for less of the daemon's CPU (bench/rpc.py --part daemon_cost)
    stream_steps: bool = True

    def __post_init__(self) -> None:
        if type(self.stream_steps) is not bool:
            raise ValueError(f"stream_steps must be True or False, got {self.stream_steps!r}")
        if type(self.source_pool) is not str:
            raise ValueError(f"source_pool must be a pool name or '', got {self.source_pool!r}")
        if self.prefix_block_size is not None and (type(self.prefix_block_size) is not int
                                                   or self.prefix_block_size < 0):
            raise ValueError("prefix_block_size must be an integer >= 0 (0: off) or None (the pool's block "
                             f"size), got {self.prefix_block_size!r}")
        if not all(type(t) is int and t >= 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be token ids >= 0, got {self.eos_token_ids!r}")
        if type(self.max_num_seqs) is not int or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if type(self.max_num_batched_tokens) is not int or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be an integer >= max_num_seqs (every running "
                             f"sequence decodes each step), got {self.max_num_batched_tokens!r}")


@dataclass
class SchedulerCounters:
    num_steps: int = 0
    num_refused_batches: int = 0
    num_preemptions: int = 0
    num_admissions: int = 0
    num_forks: int = 0
    num_finished: int = 0
    num_rejected: int = 0
    #: prompt tokens the model computed (recomputed ones included) / the prefix cache spared
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    #: prompt tokens whose K/V a step copied from another prompt of the step instead of computing
    #: them (agreeing past their shared full blocks: ``ModelStepRequest.copy_lens``)
    num_copied_tokens: int = 0
    #: prompt tokens fetched from ``source_pool``'s workers instead of computed, and
    #: transfers that failed (their tokens were computed)
    num_transferred_tokens: int = 0
    num_failed_transfers: int = 0
    num_output_tokens: int = 0
    peak_running_requests: int = 0
    peak_running_seqs: int = 0
    #: requests preempted with recompute because a worker lost (or may have lost) their KV
    num_kv_loss_preemptions: int = 0
    #: model steps that failed on a worker fault (and were recomputed)
    num_worker_faults: int = 0
    #: sequences a new leader no longer knew (lost in an ``async`` failover; their requests recomputed)
    num_lost_seqs: int = 0
    #: leader changes after which steps this scheduler had acknowledged may be lost (``async``)
    num_term_changes: int = 0
    #: requests failed because the pool was deleted or re-created under them
    num_failed: int = 0
