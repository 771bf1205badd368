"""The host tier on multi-turn chat: prefix hits, TTFT and TPOT with and without it.

    .venv/bin/python bench/tiers.py            # the real default model, rows: host tier 0, 4x, 16x
    .venv/bin/python bench/tiers.py --quick    # tiny-llama, fewer conversations (a smoke run)

Workload: ``--conversations`` conversations of ``--turns`` turns, greedy.
Each turn's prompt is the conversation's whole history (its first prompt,
then every earlier question and the model's answers) plus a new question.
A round sends every conversation's next turn, in order; each pool's client
keeps ``--max-seqs`` requests in flight and sends the next when one
finishes (``--arrivals closed``, the default, as vLLM's ``bench serve
--max-concurrency``; ``backlog`` sends the round at once, so most requests
wait for a running slot and their TTFT is mostly that wait). With a device
pool far smaller than all histories together, a conversation's history has
left the device tier by its next turn. The rows
run the same requests on a fresh cluster with the same device pool and a
host tier of 0, 4x and 16x its blocks.

Each row (one JSON line, ``name: tiers``): the prefix hit rate of turns after
the first (prompt tokens served from cache / prompt tokens), TTFT p50/p99
and TPOT p50 of those turns, output tokens/s of the whole run, offloads and
restores per second, the worker's time per restored block against its
forward time per prompt block (what recomputing it costs), whether the
verified outputs equal transformers' ``generate``, and ratios against the
no-tier row. The setup (model, precision, versions, lengths, concurrency,
hardware) is in every row.

Then the pools (``--pool-host-ratio``, default 4; negative: none): two pools
of the same geometry, each with its own worker, scheduler and host tier of
that ratio, each turn of each conversation landing on a pool drawn from the
seed (the same draws in both rows), without and with sharing (each
scheduler names the other pool as its ``source_pool``: blockd plans
transfers of the history's cached blocks, the workers fetch them), against
one pool of both pools' blocks holding every conversation. Their hit rate
counts fetched blocks as served from cache; ``ratio_hit_rate_vs_one_pool``
is the target's measure (within 5% of one pool with sharing).

With ``--vllm-python``, vLLM's rows on the same requests come first
(:mod:`bench.tiers_vllm`).

The host-tier rows also make a run report (``--report DIR``, default
``reports/tiers``; :mod:`client.report`): the rows side by side, and for
each its device and host blocks by state, utilisation, tail waste, the
prefix cache with misses by reason (evicted from the device tier, from the
host tier, ...), TTFT and TPOT, from the pool read at most every
``REPORT_INTERVAL_S``; and the block-size advisor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import run_report, tiers_vllm
from blockd.cluster.local import ClusterSpec, LocalCluster, model_config

MODEL = "smollm2-135m"
BLOCK_SIZE = 16
REPORT_INTERVAL_S = 0.05


def conversations(num: int, seed: int, vocab: int, first: tuple[int, int], question: tuple[int, int]):
    rng = random.Random(seed)
    starts = [tuple(rng.randrange(vocab) for _ in range(rng.randint(*first))) for _ in range(num)]
    questions = [[tuple(rng.randrange(vocab) for _ in range(rng.randint(*question))) for _ in range(16)]
                 for _ in range(num)]
    return starts, questions


def _metric(url: str, name: str, **labels: str) -> float:
    """One sample of a worker's /metrics (0 when it is not there)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name) and (not want or want in line):
            match = re.match(r"^[^ ]+ ([0-9.eE+-]+)$", line)
            if match:
                return float(match.group(1))
    return 0.0


def _serve_wave(scheds: list, wave: list, placement: list[int], on_step=None, in_flight: int = 0) -> dict:
    """Run one wave: request ``i`` on scheduler ``placement[i]``, the schedulers
    stepping at once (each its own pool and workers), like replicas of one model.

    ``in_flight`` 0 submits the whole wave at once (a backlog: the later
    requests wait for a running slot, so their TTFT is mostly that wait);
    otherwise each scheduler's client keeps at most that many of its requests
    submitted and sends the next, in the wave's order, when one finishes
    (closed-loop clients, as vLLM's ``bench serve --max-concurrency``): a
    request's TTFT is its own prefill beside the others' decodes."""
    from concurrent.futures import ThreadPoolExecutor

    queues: list[list] = [[] for _ in scheds]
    for req, where in zip(wave, placement, strict=True):
        queues[where].append(req)

    def serve(i: int) -> list:
        sched, queue = scheds[i], queues[i]

        def feed(s) -> None:
            while queue and (not in_flight or len(s.waiting) + len(s.running) < in_flight):
                s.add_request(queue.pop(0))

        def stepped(s) -> None:
            feed(s)  # a finished request's client sends its next one at once
            if on_step is not None:
                on_step(s)

        feed(sched)
        return sched.run(stepped)

    if len(scheds) == 1:
        return {o.request_id: o for o in serve(0)}
    with ThreadPoolExecutor(len(scheds)) as threads:
        done = list(threads.map(serve, range(len(scheds))))
    return {o.request_id: o for outputs in done for o in outputs}


def run_row(args, num_host_blocks: int, *, num_pools: int = 1, share: bool = False,
            device_blocks: int | None = None, records: list | None = None) -> tuple[dict, list, list]:
    """One row on a fresh cluster: ``num_pools`` pools of ``device_blocks``
    (default ``--device-blocks``) and ``num_host_blocks`` each; with several,
    each turn lands on a pool drawn from the seed (the same draws in every
    row), and with ``share`` each pool's scheduler names the other as its
    source pool (cross-pool transfers). With one pool and a list as
    ``records``, the row's :class:`~client.report.series.RunRecord` is added to it."""
    from client.model_group import WorkerGroup
    from client.report.series import RunRecorder
    from client.scheduler import Scheduler, SchedulerConfig
    from client.sdk import BlockdClient
    from client.serving import GREEDY, GenerationRequest, percentile

    config = model_config(args.model)
    starts, questions = conversations(args.conversations, args.seed, config.vocab_size, args.first_tokens,
                                      args.question_tokens)
    device_blocks = device_blocks or args.device_blocks
    spec = ClusterSpec(args.model, 1, "tiers", num_blocks=device_blocks, block_size=BLOCK_SIZE,
                       num_host_blocks=num_host_blocks, worker_metrics=True, num_pools=num_pools)
    draws = random.Random(args.seed + 1)
    placement = [[draws.randrange(num_pools) for _ in range(args.conversations)] for _ in range(args.turns)]
    requests, outputs, later = [], [], []
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client:
        names = spec.pool_names
        groups = [WorkerGroup(name, cluster.pool_worker_addresses(name)) for name in names]
        scheds = [Scheduler(client, name, group, SchedulerConfig(
            args.max_batched_tokens, args.max_seqs, source_pool=names[1 - i] if share and num_pools == 2 else ""))
            for i, (name, group) in enumerate(zip(names, groups, strict=True))]
        history = [tuple(s) for s in starts]
        recorder = None
        if records is not None and num_pools == 1:
            name = f"host_{num_host_blocks}_blocks" if num_host_blocks else "no_host_tier"
            recorder = RunRecorder(name, lambda: client.get_pool(names[0]), REPORT_INTERVAL_S)
            recorder.sample()  # the pool before the first request
        start = time.perf_counter()
        base = None
        for turn in range(args.turns):
            if turn == 1:  # the later turns are what a host tier or sharing can help
                base = ([client.get_pool(name) for name in names],
                        sum(s.counters.num_transferred_tokens for s in scheds))
            wave = []
            for c in range(args.conversations):
                prompt = history[c] if turn == 0 else history[c] + questions[c][turn]
                wave.append(GenerationRequest(f"c{c}-t{turn}", prompt, args.output_tokens, sampling=GREEDY))
            done = _serve_wave(scheds, wave, placement[turn],
                               (lambda _: recorder.sample()) if recorder is not None else None,
                               args.max_seqs if args.arrivals == "closed" else 0)
            if recorder is not None:
                recorder.add_outputs(done.values())
            for c, req in enumerate(wave):
                out = done[req.request_id]
                history[c] = req.prompt_token_ids + out.output_token_ids[0]
                outputs.append(out)
                if turn:
                    later.append(out)
            requests += wave
        seconds = time.perf_counter() - start
        if recorder is not None and records is not None:
            records.append(recorder.record(client.pool_config(names[0]), notes=[
                f"device tier {device_blocks} blocks, host tier {num_host_blocks} blocks"]))
        stats = [client.get_pool(name) for name in names]
        metrics = [sum(_metric(url, name, **labels) for url in cluster.worker_metrics_urls)
                   for name, labels in (("blockd_worker_kernel_duration_seconds_sum", {"kernel": "restore_blocks"}),
                                        ("blockd_worker_kernel_duration_seconds_sum", {"kernel": "model_forward"}),
                                        ("blockd_worker_tokens_processed_total", {}),
                                        ("blockd_worker_kernel_duration_seconds_sum", {"kernel": "fetch_blocks"}),
                                        ("blockd_worker_kernel_duration_seconds_sum", {"kernel": "offload_blocks"}))]
        restore_s, forward_s, tokens, fetch_s, offload_s = metrics
        for group in groups:
            group.close()
    queried = sum(s.prefix_queried_tokens - b.prefix_queried_tokens for s, b in zip(stats, base[0])) if base else 0
    hits = sum(s.prefix_hit_tokens - b.prefix_hit_tokens for s, b in zip(stats, base[0])) if base else 0
    transferred = sum(s.counters.num_transferred_tokens for s in scheds) - base[1] if base else 0
    restores, offloads = sum(s.num_restores for s in stats), sum(s.num_offloads for s in stats)
    stored = sum(s.last_event_seq_no - s.num_evictions for s in stats)
    ttft = [o.ttft_s * 1e3 for o in later]
    tpot = [o.tpot_s * 1e3 for o in later if len(o.output_token_ids[0]) > 1]
    out_tokens = sum(len(o.output_token_ids[0]) for o in outputs)
    transfers = sum(s.counters.num_transferred_tokens for s in scheds) // BLOCK_SIZE
    row = {
        "pools": num_pools, "sharing": share, "device_blocks": device_blocks,
        "host_blocks": num_host_blocks, "host_ratio": round(num_host_blocks / device_blocks, 2),
        # served from cache: hits in the pool itself, and blocks fetched from the other pool
        "hit_rate_later_turns": round((hits + transferred) / queried, 4) if queried else 0.0,
        "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "tpot_p50_ms": round(percentile(tpot, 50), 2), "tokens_per_s": round(out_tokens / seconds, 2),
        "seconds": round(seconds, 1), "offloads": offloads, "restores": restores,
        "offloads_per_s": round(offloads / seconds, 2), "restores_per_s": round(restores / seconds, 2),
        "transferred_blocks": transfers, "transfers_per_s": round(transfers / seconds, 2),
        "failed_transfers": sum(s.counters.num_failed_transfers for s in scheds),
        # the workers' own clocks: copying one block back (or fetching it from the other pool's
        # worker) against running its 16 tokens through the model
        "restore_ms_per_block": round(restore_s / restores * 1e3, 4) if restores else None,
        "offload_ms_per_block": round(offload_s / offloads * 1e3, 4) if offloads else None,
        # write-back (this policy) copies the blocks the device tier gives up; write-through would
        # copy every block as it is committed (each BlockStored event: events less evictions)
        "stored_blocks": stored, "write_through_copies_per_write_back_copy": (
            round(stored / offloads, 2) if offloads else None),
        "fetch_ms_per_block": round(fetch_s / transfers * 1e3, 4) if transfers else None,
        "forward_ms_per_prompt_block": round(forward_s / tokens * BLOCK_SIZE * 1e3, 3) if tokens else None,
        "prompt_tokens_computed": sum(s.counters.num_prefill_tokens for s in scheds),
        "prompt_tokens_cached": sum(s.counters.num_cached_tokens for s in scheds),
    }
    return row, requests, outputs


def verify(model: str, requests, outputs, num: int) -> dict:
    """Whether the first turn's first requests and the last turn's equal transformers' ``generate``."""
    from worker.model.reference import ContiguousReference

    picked = requests[:num // 2] + requests[-(num - num // 2):]
    problems = ContiguousReference(model).mismatches(picked, outputs)
    return {"verified_requests": len(picked), "outputs_match_reference": not problems,
            **({"reference_problems": problems[:3]} if problems else {})}


def setup(args) -> dict:
    import grpc
    import torch
    import transformers

    config = model_config(args.model)
    return {
        "model": {"name": args.model, "num_hidden_layers": config.num_hidden_layers,
                  "num_key_value_heads": config.num_key_value_heads, "vocab_size": config.vocab_size},
        "precision": "float32",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "grpcio": grpc.__version__, "python": platform.python_version()},
        "hardware": {"cpu_count": os.cpu_count(), "machine": platform.machine(), "device": "cpu"},
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "first_prompt_tokens": list(args.first_tokens), "question_tokens": list(args.question_tokens),
                     "output_tokens": args.output_tokens, "sampling": "greedy", "seed": args.seed,
                     "tokens": "random ids (the KV and the cache do not depend on their meaning)"},
        "pool": {"device_blocks": args.device_blocks, "block_size": BLOCK_SIZE},
        "concurrency": {"max_num_seqs": args.max_seqs, "max_num_batched_tokens": args.max_batched_tokens,
                        "arrivals": args.arrivals,
                        "in_flight_per_pool": args.max_seqs if args.arrivals == "closed" else args.conversations},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama, 6 conversations of 3 turns")
    parser.add_argument("--model", default=None, help=f"model spec (default {MODEL}; tiny-llama with --quick)")
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratios", default="0,4,16", help="host tier sizes, in device pools (default 0,4,16)")
    parser.add_argument("--verify", type=int, default=6, help="requests checked against transformers (default 6)")
    parser.add_argument("--vllm-python", default=None,
                        help="a vLLM venv's python: vLLM's rows on the same requests first (bench/tiers_vllm.py)")
    parser.add_argument("--report", default="reports/tiers", metavar="DIR",
                        help="the host-tier rows' run report (report.html and its PNGs) goes here; '' for none")
    parser.add_argument("--arrivals", choices=("closed", "backlog"), default="closed",
                        help="closed (default): each pool's client keeps --max-seqs requests in flight and sends "
                             "the next when one finishes (vLLM's bench serve --max-concurrency); backlog: a round's "
                             "requests all at once, most of them waiting for a running slot")
    parser.add_argument("--pool-host-ratio", type=float, default=4.0,
                        help="the host tier of each pool in the two-pool rows, in device pools (default 4; "
                             "negative: no two-pool rows)")
    args = parser.parse_args(argv)
    args.model = args.model or ("tiny-llama" if args.quick else MODEL)
    args.conversations = args.conversations or (6 if args.quick else 12)
    if args.conversations < 1 or args.turns < 2 or args.verify < 0:
        parser.error("--conversations >= 1, --turns >= 2 and --verify >= 0")
    ratios = [float(r) for r in args.ratios.split(",")]
    if not ratios or ratios[0] != 0 or any(r < 0 for r in ratios):
        parser.error("--ratios must start at 0 (the row the others are compared with)")
    if args.quick:  # the tiny models have 256 positions
        args.first_tokens, args.question_tokens, args.output_tokens = (40, 64), (8, 16), 8
        args.device_blocks, args.max_seqs, args.max_batched_tokens = 24, 2, 128
    else:
        args.first_tokens, args.question_tokens, args.output_tokens = (96, 160), (16, 32), 24
        args.device_blocks, args.max_seqs, args.max_batched_tokens = 96, 4, 512
    common = {"name": "tiers", **setup(args)}
    against_vllm = tiers_vllm.anchor(args, common, conversations)  # prints vLLM's rows (none without the flag)
    base = None
    records: list | None = [] if args.report else None
    for ratio in ratios:
        row, requests, outputs = run_row(args, int(ratio * args.device_blocks), records=records)
        row.update(verify(args.model, requests, outputs, args.verify) if args.verify else {})
        row.update(against_vllm(row, requests, outputs))
        if base is None:
            base = row
        row["ratio_hit_rate_vs_no_tier"] = (round(row["hit_rate_later_turns"] / base["hit_rate_later_turns"], 2)
                                            if base["hit_rate_later_turns"] else None)
        row["ratio_ttft_p50_vs_no_tier"] = round(row["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
        row["ratio_tpot_p50_vs_no_tier"] = round(row["tpot_p50_ms"] / base["tpot_p50_ms"], 3)
        print(json.dumps({**common, **row}), flush=True)
    if records:
        setting = (f"{args.conversations} conversations of {args.turns} turns on {args.model}, {args.max_seqs} "
                   f"running at once, device pool {args.device_blocks} blocks of {BLOCK_SIZE}; the same requests "
                   f"on a fresh cluster per host tier size; the pool read at most every {REPORT_INTERVAL_S} s")
        run_report.write(args.report, "bench/tiers.py: multi-turn chat with and without a host tier", records,
                         sys.stderr, [setting])
    if args.pool_host_ratio >= 0:
        pool_rows(args, common)
    return 0


def pool_rows(args, common: dict) -> None:
    """Two pools (two workers), each turn landing on either, without and with
    sharing across them, against one pool of both pools' blocks holding every
    conversation (the hit rate sharing should come close to)."""
    host = int(args.pool_host_ratio * args.device_blocks)
    one, requests, outputs = run_row(args, 2 * host, device_blocks=2 * args.device_blocks)
    one.update(verify(args.model, requests, outputs, args.verify) if args.verify else {})
    one["row"] = "one pool holding all conversations"
    print(json.dumps({**common, **one}), flush=True)
    for share in (False, True):
        row, requests, outputs = run_row(args, host, num_pools=2, share=share)
        row.update(verify(args.model, requests, outputs, args.verify) if args.verify else {})
        row["row"] = "two pools, " + ("sharing prefixes" if share else "no sharing")
        row["ratio_hit_rate_vs_one_pool"] = (round(row["hit_rate_later_turns"] / one["hit_rate_later_turns"], 3)
                                             if one["hit_rate_later_turns"] else None)
        print(json.dumps({**common, **row}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
