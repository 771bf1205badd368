"""A real model on a real cluster: ``blockd serve`` and ``blockd-worker --model``
processes on loopback, driven by :class:`client.scheduler.Scheduler`.

Generation for a batch of prompts (different lengths, shared long prefixes,
parallel samples, a pool small enough to force preemption) must give exactly
the tokens transformers' own ``generate`` with its contiguous cache gives for
the same tiny model -- greedy, and seeded samples with the workers' draws
forced (:mod:`worker.model.reference`), so a seeded request draws the same tokens
after preemption, on one worker and on a tensor-parallel pair. Then
``python -m bench.demo`` as a user runs it (the real default model):
it must succeed, show text, and leave no process behind, also on Ctrl-C.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from blockd.cluster.local import ROOT, ClusterSpec, LocalCluster, live_pids
from client.model_group import WorkerGroup
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from client.serving import GREEDY, GenerationRequest, SamplingParams
from worker.model.reference import ContiguousReference
from worker.openmp import WORKER_SPIN_COUNT

VOCAB = 512  # the tiny models' vocabulary


def workload(seed: int) -> list[GenerationRequest]:
    """Greedy requests, and seeded sampled ones (every other request with several samples)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(n)) for n in (37, 52)]
    requests = []
    for i in range(12):
        prefix = prefixes[i % 3] if i % 3 < 2 else ()
        prompt = prefix + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 30)))
        n = (1, 2, 1, 3)[i % 4]
        sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i) if i % 8 in (1, 3, 4) else GREEDY
        requests.append(GenerationRequest(f"r{i}", prompt, rng.randint(4, 24), n=n, sampling=sampling))
    return requests


@pytest.mark.parametrize(("model", "tp_size", "compiled"),
                         [("tiny-llama", 1, "off"), ("tiny-qwen2", 2, None), ("tiny-llama", 1, "mkl"),
                          ("tiny-llama", 1, None)])
def test_paged_cluster_generates_what_the_contiguous_reference_does(model, tp_size, compiled, monkeypatch,
                                                                      tmp_path):
    """The TP pair also shares prompt prefixes within a burst (prefix_block_size),
    and runs eager (the default ``--compile auto`` says why). With ``--compile
    mkl`` the worker compiles its buckets before it is ready and its decode steps
    (padded to 4, 8 or 16 rows) give the same tokens; with the default it times
    and chooses the code of the buckets its 26-block pool can fill (16, 32)."""
    if compiled is not None:
        monkeypatch.setenv("BLOCKD_WORKER_COMPILE", compiled)
    else:
        monkeypatch.delenv("BLOCKD_WORKER_COMPILE", raising=False)
    if compiled == "mkl":
        monkeypatch.setenv("BLOCKD_WORKER_COMPILE_BUCKETS", "4,8,16")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    requests = workload(tp_size)
    spec = ClusterSpec(model, tp_size, "m", num_blocks=26, block_size=8, watermark_blocks=1)
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("m", cluster.worker_addresses) as group:
        assert len(cluster.worker_addresses) == tp_size
        for worker in cluster.workers:  # idle OpenMP threads spin briefly, then sleep (worker/openmp.py)
            with open(f"/proc/{worker.pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
                assert f"GOMP_SPINCOUNT={WORKER_SPIN_COUNT}".encode() in environ
        config = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=16,
                                 prefix_block_size=spec.block_size if tp_size == 2 else 0)
        sched = Scheduler(client, "m", group, config)
        for req in requests:
            sched.add_request(req)
        outputs = sched.run()
        stats = client.get_pool("m")
        workers = client.list_workers("m")
    assert ContiguousReference(model).mismatches(requests, outputs) == []
    warmed = [line for worker in cluster.workers for line in worker.lines if "compiled decode forward warmed" in line]
    assert len(warmed) == (0 if compiled == "off" or tp_size > 1 else 1), warmed
    if compiled == "mkl":
        assert "4 rows: mkl; 8 rows: mkl; 16 rows: mkl" in warmed[0]
    elif compiled is None and tp_size == 1:
        assert re.search(r"16 rows: (eager|onednn|mkl) \(eager [\d.]+ ms, onednn [\d.]+ ms.*32 rows:", warmed[0])
    eager_why = [line for worker in cluster.workers for line in worker.lines if "decode steps run eager" in line]
    assert len(eager_why) == (tp_size if tp_size > 1 else 0), eager_why
    assert all("tensor parallelism runs eager" in line for line in eager_why)
    by_id = {out.request_id: out for out in outputs}
    sampled = [by_id[req.request_id].output_token_ids for req in requests if req.n > 1 and not req.sampling.is_greedy]
    assert sampled and all(len(set(samples)) == len(samples) for samples in sampled), "samples differ"
    c = sched.counters
    assert c.num_preemptions > 0, "the pool is small enough to force preemption"
    # a request preempted between its prompt's end and the fork allocates its samples instead
    assert 0 < c.num_forks <= sum(req.n - 1 for req in requests)
    assert stats.prefix_hit_tokens > 0 and stats.num_copies > 0
    assert stats.num_seqs == 0 and stats.num_used_blocks == 0
    assert sorted(w.info.kv_head_end - w.info.kv_head_start for w in workers) == [2 // tp_size] * tp_size
    assert all(out.ttft_s > 0 and out.tpot_s > 0 and out.tokens_per_s > 0 for out in outputs)


def test_prompts_sharing_a_prefix_are_computed_in_one_step_sharing_its_blocks():
    """A burst of prompts with a common 3-block prefix: the first step admits
    them all, the first one computes the prefix and the others take its
    blocks in that very step (``Allocate.share_seq_id``, as vLLM shares
    blocks within a step), and every output equals the contiguous reference.
    Without the worker counting the step's own slots as written, that step
    is refused (KV_NOT_WRITTEN) and nothing is admitted in it."""
    rng = random.Random(7)
    prefix = tuple(rng.randrange(VOCAB) for _ in range(24))
    requests = [GenerationRequest(f"s{i}", prefix + tuple(rng.randrange(VOCAB) for _ in range(3 + i)), 6)
                for i in range(3)]
    spec = ClusterSpec("tiny-llama", 1, "s", num_blocks=32, block_size=8, watermark_blocks=1)
    with LocalCluster(spec) as cluster, BlockdClient(cluster.blockd_address) as client, \
            WorkerGroup("s", cluster.worker_addresses) as group:
        sched = Scheduler(client, "s", group, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
        for req in requests:
            sched.add_request(req)
        sched.step()
        assert len(sched.running) == 3 and not sched.waiting
        assert sched.counters.num_cached_tokens == 2 * 24  # the second and third prompts' prefix
        assert sched.counters.num_prefill_tokens == sum(len(r.prompt_token_ids) for r in requests) - 2 * 24
        outputs = sched.run()
        assert sched.counters.num_kv_loss_preemptions == 0
    assert ContiguousReference("tiny-llama").mismatches(requests, outputs) == []


def _demo(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "bench.demo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _child_pids(output: str, count: int) -> list[int]:
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", output)]
    assert len(pids) == count, output  # blockd and the workers
    return pids


def test_cluster_demo_matches_the_reference_and_leaves_nothing_behind(tmp_path):
    """``make demo`` as it is (the real model, one worker), on fewer requests;
    its run report is drawn (the report itself: tests/client/test_report.py)."""
    proc = _demo("--requests", "5", "--rate", "2", "--report", str(tmp_path / "report"))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert "outputs match the contiguous reference" in output
    if importlib.util.find_spec("matplotlib") is not None:
        assert f"run report: {tmp_path / 'report' / 'report.html'}" in output
        assert (tmp_path / "report" / "demo_blocks.png").stat().st_size > 0
    for label in ("time to first token", "time per output token", "tokens/s", "pool utilisation",
                  "tail waste", "prefix hit rate", "finished   5/5", "some answers", "tokens, "):
        assert label in output, label
    assert live_pids(_child_pids(output, 2)) == []


def test_cluster_demo_stops_its_cluster_on_ctrl_c():
    proc = _demo("--model", "tiny-llama", "--tp", "2", "--requests", "5000")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[") and " step " in line:  # serving: the cluster is up
            break
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "interrupted" in rest and time.monotonic() - start < 15
    assert live_pids(_child_pids(output, 3)) == []
