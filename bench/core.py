"""In-process allocator benchmarks (issue: allocator core).

Prints one JSON object per line:

* ``decode_step``: one token appended to each of N running sequences (block
  size 16) as one columnar ``DecodeAppend`` op; ``ratio_vs_per_op`` compares
  it with the same step sent as N single ``Append`` ops, measured in this run.
* ``prefill_alloc``: 256 prompts of 512 tokens, half of them sharing a
  256-token prefix that is already cached; ``ratio_vs_unshared`` compares it
  with 256 prompts that share nothing.
* ``pool_scaling``: the 256-sequence decode step on pools of 1k and 1M
  blocks; ``ratio_vs_1k`` shows the cost does not grow with the pool.
* ``decode_step_build``: the 256-sequence decode step of the core as this
  install built it (``blockd.core.BUILD``: compiled with mypyc by
  ``setup.py``, or Python) against the same core run from its sources
  (``BLOCKD_PURE_PYTHON=1``), each in child processes that take turns;
  ``ratio_vs_python`` is the geometric mean over rounds of the build's CPU
  time per step over the sources' (< 1 is faster; 1.0 where nothing is
  compiled; ``child_builds`` is what each child says it ran). The rows above
  run the build too; each row names it in ``build``.
* ``decode_step_vs_rev`` (only with ``--against REV``): the 256-sequence
  decode step of this tree's core and of the core at git revision ``REV``,
  both imported into this process and stepped alternately, so load from
  other processes hits both alike (which one is set up first alternates by
  round, and the rounds are made even, so that bias cancels);
  ``ratio_vs_rev`` is the geometric mean over rounds of this tree's median
  step time over the revision's (< 1 is faster). Use it to check a change to
  the core against the commit before it. Both run from source: the
  revision's core is imported from its ``.py`` files, so a compiled install
  re-runs this benchmark with ``BLOCKD_PURE_PYTHON=1`` (its ``build`` says
  so) rather than set compiled code against sources.

Absolute times drift ±20% on shared machines; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import blockd.core
from blockd.core import Allocate, Append, Commit, Pool, PoolConfig
from blockd.core.types import DecodeAppend

BLOCK = 16


def emit(name: str, **fields) -> None:
    print(json.dumps({"name": name, **fields, "build": blockd.core.BUILD, "python": platform.python_version()}),
          flush=True)


def running_pool(num_seqs: int, num_blocks: int, prompt_len: int) -> tuple[Pool, list[str]]:
    pool = Pool(PoolConfig("bench", num_blocks=num_blocks, block_size=BLOCK))
    ids = [f"seq-{i}" for i in range(num_seqs)]
    restart(pool, ids, prompt_len, free=False)
    return pool, ids


def restart(pool, ids: list[str], prompt_len: int, *, core: ModuleType = blockd.core, free: bool = True) -> None:
    """(Re)start every sequence of the decode workload with its prompt, untimed
    (``core``: the module ``pool`` comes from, for ``--against``)."""
    if free:
        pool.step([core.Free(s) for s in ids])
    pool.step([core.Allocate(s, [i % 30000] * prompt_len) for i, s in enumerate(ids)])


def time_decode(num_seqs: int, num_blocks: int, steps: int, columnar: bool, prompt_len: int = 31) -> float:
    """Median µs per decode step. Every 16 steps each sequence crosses one block
    boundary; sequences are reset (untimed) so small pools never fill up."""
    pool, ids = running_pool(num_seqs, num_blocks, prompt_len)
    tokens = [7] * num_seqs
    samples = []
    gc.collect()
    for done in range(steps):
        if done and done % BLOCK == 0:
            restart(pool, ids, prompt_len)
        start = time.perf_counter()
        if columnar:
            pool.step([DecodeAppend(ids, tokens)])
        else:
            pool.step([Append(s, [7]) for s in ids])
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def bench_decode(steps: int) -> None:
    for num_seqs in (256, 4096):
        n = steps if num_seqs == 256 else max(32, steps // 8)
        per_op = time_decode(num_seqs, 200_000, n, columnar=False)
        columnar = time_decode(num_seqs, 200_000, n, columnar=True)
        emit("decode_step", num_seqs=num_seqs, block_size=BLOCK, steps=n, us_per_step=round(columnar, 1),
             us_per_seq=round(columnar / num_seqs, 3), per_op_us_per_step=round(per_op, 1),
             ratio_vs_per_op=round(columnar / per_op, 3), target_us=200 if num_seqs == 256 else None)


def time_prefill(shared: bool, repeats: int) -> float:
    samples = []
    prefix = list(range(1000, 1256))
    for _ in range(repeats):
        pool = Pool(PoolConfig("bench", num_blocks=16_384, block_size=BLOCK))
        pool.step([Allocate("warm", [*prefix, 1]), Commit("warm", 257)])  # the shared prefix is cached
        ops = []
        for i in range(256):
            head = prefix if shared and i % 2 == 0 else [(i * 7 + j) % 30000 for j in range(256)]
            ops.append(Allocate(f"p{i}", head + [(i * 13 + j) % 30000 for j in range(256)]))
        start = time.perf_counter()
        result = pool.step(ops)
        samples.append(time.perf_counter() - start)
        hits = sum(r.num_cached_tokens for r in result.results)
    return statistics.median(samples) * 1e6, hits


def bench_prefill(repeats: int) -> None:
    unshared, _ = time_prefill(False, repeats)
    shared, hits = time_prefill(True, repeats)
    emit("prefill_alloc", num_prompts=256, prompt_len=512, shared_prefix_len=256, shared_fraction=0.5,
         block_size=BLOCK, us_per_batch=round(shared, 1), us_per_prompt=round(shared / 256, 2),
         cached_tokens=hits, unshared_us_per_batch=round(unshared, 1),
         ratio_vs_unshared=round(shared / unshared, 3))


def bench_pool_scaling(steps: int) -> None:
    small = time_decode(256, 1_000, steps, columnar=True)
    large = time_decode(256, 1_000_000, steps, columnar=True)
    for num_blocks, us in ((1_000, small), (1_000_000, large)):
        emit("pool_scaling", num_blocks=num_blocks, num_seqs=256, block_size=BLOCK, us_per_step=round(us, 1),
             ratio_vs_1k=round(us / small, 3))


def cpu_us_per_decode_step(steps: int, num_seqs: int = 256, prompt_len: int = 31) -> float:
    """This process's CPU µs per step of :func:`time_decode`'s workload (its
    untimed restarts excluded): what ``--cpu-per-step`` prints for the parent."""
    pool, ids = running_pool(num_seqs, 200_000, prompt_len)
    tokens = [7] * num_seqs
    cpu = 0
    gc.collect()
    for done in range(-2 * BLOCK, steps):  # two blocks' worth of steps warm up, untimed
        if done % BLOCK == 0:
            restart(pool, ids, prompt_len)
        start = time.process_time_ns()
        pool.step([DecodeAppend(ids, tokens)])
        if done >= 0:
            cpu += time.process_time_ns() - start
    return cpu / steps / 1e3


def bench_build(steps: int, rounds: int) -> None:
    builds = {}

    def child(pure: bool) -> float:
        env = {**os.environ, "BLOCKD_PURE_PYTHON": "1"} if pure else None  # else: the build this process runs
        out = subprocess.run([sys.executable, __file__, "--cpu-per-step", str(steps)], env=env, check=True,
                             capture_output=True, text=True).stdout
        build, _, cpu = out.strip().rpartition(" ")
        builds[pure] = build  # what the child ran, as it says: the row shows both
        return float(cpu)

    built: list[float] = []
    sources: list[float] = []
    for round_no in range(rounds + rounds % 2):
        first_pure = bool(round_no % 2)  # which child runs first alternates, so drift hits both alike
        a, b = child(first_pure), child(not first_pure)
        built.append(b if first_pure else a)
        sources.append(a if first_pure else b)
    emit("decode_step_build", num_seqs=256, block_size=BLOCK, steps=steps, rounds=len(built),
         cpu_us_per_step=round(statistics.median(built), 1),
         python_cpu_us_per_step=round(statistics.median(sources), 1),
         ratio_vs_python=round(statistics.geometric_mean(a / b for a, b in zip(built, sources)), 3),
         child_builds=[builds[False], builds[True]],
         compiled_modules=list(blockd.core.COMPILED) if blockd.core.BUILD == "compiled" else [])


def core_at(rev: str, into: str) -> ModuleType:
    """``blockd.core`` as of git revision ``rev``, imported as ``blockd_at_rev.core``
    (its own imports renamed to match) so it runs beside this tree's core."""
    archive = subprocess.run(["git", "archive", rev, "blockd/core"], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                data = tar.extractfile(member)
                assert data is not None
                path = os.path.join(into, "blockd_at_rev", "core", os.path.basename(member.name))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as out:
                    out.write(data.read().decode().replace("blockd.core", "blockd_at_rev.core"))
    with open(os.path.join(into, "blockd_at_rev", "__init__.py"), "w"):
        pass
    sys.path.insert(0, into)
    return importlib.import_module("blockd_at_rev.core")


def time_decode_paired(cores: list[ModuleType], steps: int, num_seqs: int = 256,
                       prompt_len: int = 31) -> list[float]:
    """Median µs per decode step for each core, stepping them in turn (the
    order flips every step); the workload is :func:`time_decode`'s."""
    setups = []
    for core in cores:
        pool = core.Pool(core.PoolConfig("bench", num_blocks=200_000, block_size=BLOCK))
        ids = [f"seq-{i}" for i in range(num_seqs)]
        setups.append((core, pool, ids))
    tokens = [7] * num_seqs
    samples: list[list[float]] = [[] for _ in cores]
    gc.collect()
    for done in range(steps):
        if done % BLOCK == 0:  # (re)start every sequence, untimed
            for core, pool, ids in setups:
                restart(pool, ids, prompt_len, core=core, free=bool(done))
        order = range(len(setups)) if done % 2 else reversed(range(len(setups)))
        for k in order:
            core, pool, ids = setups[k]
            op = [core.DecodeAppend(ids, tokens)]
            start = time.perf_counter()
            pool.step(op)
            samples[k].append(time.perf_counter() - start)
    return [statistics.median(s) * 1e6 for s in samples]


def bench_against(rev: str, steps: int, rounds: int) -> None:
    ours: list[float] = []
    theirs: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        cores = [blockd.core, core_at(rev, tmp)]
        for round_no in range(rounds + rounds % 2):
            # which pool is built first shifts step times by a few percent; alternate it
            flip = round_no % 2
            times = time_decode_paired(cores[::-1] if flip else cores, steps)
            ours.append(times[flip])
            theirs.append(times[1 - flip])
    emit("decode_step_vs_rev", rev=rev, num_seqs=256, block_size=BLOCK, steps=steps, rounds=len(ours),
         us_per_step=round(statistics.median(ours), 1), rev_us_per_step=round(statistics.median(theirs), 1),
         ratio_vs_rev=round(statistics.geometric_mean(a / b for a, b in zip(ours, theirs)), 3),
         ratios=[round(a / b, 3) for a, b in zip(ours, theirs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for smoke tests)")
    parser.add_argument("--against", metavar="REV",
                        help="only compare the decode step with the core at this git revision (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of --against, made even (default 8)")
    # decode_step_build's children
    parser.add_argument("--cpu-per-step", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_per_step:
        print(blockd.core.BUILD, round(cpu_us_per_decode_step(args.cpu_per_step), 2))
        return
    steps = 64 if args.quick else 512
    if args.against:
        if blockd.core.BUILD == "compiled":  # like against like: the revision's core runs from source
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                      {**os.environ, "BLOCKD_PURE_PYTHON": "1"})
        bench_against(args.against, steps, args.rounds)
        return
    bench_decode(steps)
    bench_prefill(2 if args.quick else 7)
    bench_pool_scaling(steps)
    bench_build(steps, 2 if args.quick else 6)


if __name__ == "__main__":
    main()
