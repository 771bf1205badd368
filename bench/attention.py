"""Paged attention vs contiguous attention and vLLM's CPU kernel, plus a memory-bandwidth probe.

Prints one JSON object per line:

* ``{"name": "bandwidth", "op": "sum" | "copy", "gbps": ...}``: bytes a large
  tensor sum reads (or a copy reads + writes) per second: the roofline.
* ``{"name": "paged_decode", ...}``: :class:`worker.kernels.PagedAttention`
  (its default backend: ``backend`` says which) on one pool layer with shuffled
  block tables, batch 32, 32 query heads, head dim 128, block 16. Baselines on
  the same K/V, timed in the same run:

  - ``contiguous_ms``: the fastest contiguous SDPA on a CPU: K/V as
    ``[batch, kv_heads, context, D]`` and each KV head's query group folded into
    the query length (``q.view(B, Hkv, G, D)``), so no K/V is repeated;
  - ``vllm_ms``: vLLM's fused CPU kernel (``cpu_attention_with_kv_cache``, the
    faster of its split/unsplit schedules), when ``vllm`` imports;
  - ``torch_backend_ms``: blockd's own tiled torch kernels (the fallback backend).

  ``ratio_vs_*`` = blockd ms / that ms (below 1: blockd is faster); ``gbps`` =
  K+V bytes read per second; ``plan_ms`` is the once-per-batch ``plan()`` (min
  of 5) that the per-layer ``ms`` excludes; ``max_abs_err`` against float32 SDPA.
* ``{"name": "paged_prefill", ...}``: causal prefill (a whole prompt) and
  chunked prefill (new tokens after cached ones), same fields plus ``gflops``
  (blockd's QK^T + PV flops per second over the causally visible pairs); the contiguous
  baseline is SDPA over K/V expanded to every query head with the causal mask
  aligned to the last keys.
* ``{"name": "written_check", ...}``: what the worker adds per layer so it never
  attends over KV it has not written in its incarnation (:mod:`worker.written`):
  recording a decode batch's new slots (``mark_ms``) and checking every slot
  the batch reads (``check_ms``), against the paged decode kernel on the same
  batch in this run (``ratio_vs_paged_decode``); ``plan_ms`` is once per batch.

Candidates are timed interleaved, round by round, and each reports its best
round, so a shared machine's load drifts hit them alike (``loadavg_1m`` says
how loaded it was). vLLM runs in its own venv: ``PYTHONPATH=. /path/to/vllm-venv/bin/python
bench/attention.py``. ``--device cuda`` times the CUDA backend (FlashInfer when
installed) against contiguous SDPA, with CUDA events, and probes HBM bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention_baselines import VllmKernel, contiguous, vllm_available
from worker.kernels import PagedAttention, native
from worker.layout import KVGeometry, allocate_kv_pool
from worker.written import ContextBlocks, WrittenSlots

BATCH, Q_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 128, 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_best(candidates: dict, rounds: int, device: torch.device) -> dict[str, float]:
    """Best seconds of each candidate; every round runs all of them, in alternating order."""
    names = list(candidates)
    for fn in candidates.values():  # warm-up: first touch, dispatch, caches
        fn()
    best = dict.fromkeys(names, float("inf"))
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            sync(device)
            start = time.perf_counter()
            candidates[name]()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bandwidth(rounds: int, device: torch.device) -> list[dict]:
    """Read (sum) and read+write (copy) throughput of a 512 MiB float32 tensor."""
    x = torch.ones(128 << 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    t = interleaved_best({"sum": x.sum, "copy": lambda: y.copy_(x)}, rounds, device)
    return [{"name": "bandwidth", "device": device.type, "op": "sum", "gbps": round(nbytes / t["sum"] / 1e9, 2),
             "bytes": nbytes},
            {"name": "bandwidth", "device": device.type, "op": "copy",
             "gbps": round(2 * nbytes / t["copy"] / 1e9, 2), "bytes": 2 * nbytes}]


def make_pool(num_seqs: int, context: int, kv_heads: int, dtype: torch.dtype, device: torch.device, seed=0):
    """A random one-layer pool and shuffled block tables (``[seqs, context / b]``)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    geometry = KVGeometry(1, num_seqs * blocks_per_seq, BLOCK_SIZE, kv_heads, HEAD_DIM)
    kv = allocate_kv_pool(geometry, dtype)
    kv.normal_(generator=gen)
    tables = torch.randperm(geometry.num_blocks, generator=gen).view(num_seqs, blocks_per_seq)
    return kv[0].to(device), tables.to(torch.int32)


def planned(backend: str | None, device, tables, context_lens, starts, kv_heads, dtype):
    """A planned wrapper and the best of 5 ``plan()`` times (ms)."""
    wrapper = PagedAttention(device=device, backend=backend)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        wrapper.plan(tables.to(device), context_lens.to(device), None if starts is None else starts.to(device),
                     num_q_heads=Q_HEADS, num_kv_heads=kv_heads, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                     kv_dtype=dtype)
        times.append(time.perf_counter() - start)
    return wrapper, min(times) * 1e3


def measure(name: str, layer, tables, context_lens, starts, query, args) -> dict:
    """Blockd vs the baselines on one batch (see the module docstring)."""
    device, dtype, kv_heads = layer.device, layer.dtype, layer.shape[2]
    wrapper, plan_ms = planned(None, device, tables, context_lens, starts, kv_heads, dtype)
    out = torch.empty_like(query)

    def blockd() -> torch.Tensor:
        return wrapper.run(query, layer, out=out)

    reference, dense = contiguous(layer, tables, context_lens, starts, query)
    t = interleaved_best({"blockd": blockd, "contiguous": dense}, args.rounds, device)
    row = {"name": name, "backend": wrapper.backend, "ms": t["blockd"] * 1e3, "plan_ms": round(plan_ms, 3),
           "contiguous_ms": t["contiguous"] * 1e3, "ratio_vs_contiguous": t["blockd"] / t["contiguous"]}
    row["max_abs_err"] = (wrapper.run(query, layer).float() - reference).abs().max().item()
    del dense
    if device.type == "cpu" and vllm_available() and not args.no_vllm:
        vllm = VllmKernel(layer, tables, context_lens, starts, query)
        t = interleaved_best({"blockd": blockd, "vllm": vllm.run}, args.rounds, device)
        row.update(vllm_ms=t["vllm"] * 1e3, ratio_vs_vllm=t["blockd"] / t["vllm"], vllm_isa=vllm.isa,
                   vllm_max_abs_err=(vllm.run().float() - reference).abs().max().item())
        row["ms"] = min(row["ms"], t["blockd"] * 1e3)
        del vllm
    if wrapper.backend != "torch" and not args.no_torch_backend:
        torch_wrapper, torch_plan_ms = planned("torch", device, tables, context_lens, starts, kv_heads, dtype)
        t = interleaved_best({"blockd": blockd, "torch": lambda: torch_wrapper.run(query, layer, out=out)},
                             args.rounds, device)
        row.update(torch_backend_ms=t["torch"] * 1e3, torch_backend_plan_ms=round(torch_plan_ms, 3),
                   ratio_vs_torch_backend=t["blockd"] / t["torch"])
    if wrapper.backend == "torch" and native.failure():
        row["native_error"] = native.failure()[:300]
    return row


def finish(row: dict, layer, query, tables, context_lens) -> dict:
    """Shape fields, GB/s, rounding, and the machine's state."""
    kv_bytes = 2 * int(context_lens.sum()) * layer.shape[2] * HEAD_DIM * layer.element_size()
    out = {"name": row.pop("name"), "batch": tables.shape[0], "q_heads": query.shape[1],
           "kv_heads": layer.shape[2], "head_dim": HEAD_DIM, "dtype": str(layer.dtype).removeprefix("torch."),
           "block_size": BLOCK_SIZE, "device": layer.device.type, **row}
    for key in [k for k in out if k.endswith("_ms") or k == "ms"]:
        out[key.removesuffix("ms") + "gbps" if key != "ms" else "gbps"] = round(kv_bytes / out[key] / 1e6, 2)
        out[key] = round(out[key], 3)
    for key in [k for k in out if k.startswith("ratio")]:
        out[key] = round(out[key], 3)
    out.pop("plan_gbps", None)
    out.pop("torch_backend_plan_gbps", None)
    out.update(threads=torch.get_num_threads(), loadavg_1m=round(os.getloadavg()[0], 2))
    return out


def decode_case(kv_heads: int, context: int, dtype: torch.dtype, args) -> dict:
    layer, tables = make_pool(BATCH, context, kv_heads, dtype, args.device)
    lens = torch.full((BATCH,), context, dtype=torch.int32)
    query = torch.randn(BATCH, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    query = query.to(args.device)
    row = measure("paged_decode", layer, tables, lens, None, query, args)
    return finish({**row, "context": context}, layer, query, tables, lens)


def prefill_case(num_seqs: int, new_tokens: int, context: int, dtype: torch.dtype, args) -> dict:
    """``num_seqs`` sequences, each with ``new_tokens`` query tokens ending a ``context``-token history."""
    layer, tables = make_pool(num_seqs, context, 8, dtype, args.device)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    starts = torch.arange(0, num_seqs * new_tokens + 1, new_tokens, dtype=torch.int32)
    query = torch.randn(num_seqs * new_tokens, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    query = query.to(dtype).to(args.device)
    row = measure("paged_prefill", layer, tables, lens, starts, query, args)
    pairs = num_seqs * (new_tokens * (context - new_tokens) + new_tokens * (new_tokens + 1) // 2)
    gflop = 4 * pairs * Q_HEADS * HEAD_DIM / 1e9  # QK^T and PV, 2 flops per multiply-add
    row["gflops"] = round(gflop / row["ms"] * 1e3, 2)
    return finish({**row, "context": context, "new_tokens": new_tokens}, layer, query, tables, lens)


def best_seconds(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def written_check_case(context: int, paged_ms: float, rounds: int) -> dict:
    """The written-slot record of a decode batch like :func:`decode_case`'s."""
    blocks_per_seq = context // BLOCK_SIZE
    tables = torch.randperm(BATCH * blocks_per_seq, generator=torch.Generator().manual_seed(0))
    tables = tables.view(BATCH, blocks_per_seq)
    written = WrittenSlots(1, BATCH * blocks_per_seq, BLOCK_SIZE)
    written.mark(0, torch.arange(BATCH * blocks_per_seq * BLOCK_SIZE))
    lengths = torch.full((BATCH,), context, dtype=torch.int64)
    plan_start = time.perf_counter()
    batch = ContextBlocks.of(tables, lengths, BLOCK_SIZE)
    plan_ms = (time.perf_counter() - plan_start) * 1e3
    new_slots = tables[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1  # each sequence's newest token
    seq_ids = [f"s{i}" for i in range(BATCH)]
    mark = best_seconds(lambda: written.mark(0, new_slots), rounds * 4)
    check = best_seconds(lambda: written.check(0, batch, seq_ids, lengths), rounds * 4)
    return {"name": "written_check", "batch": BATCH, "context": context, "block_size": BLOCK_SIZE,
            "mark_ms": round(mark * 1e3, 4), "check_ms": round(check * 1e3, 4), "plan_ms": round(plan_ms, 3),
            "paged_decode_ms": round(paged_ms, 3), "ratio_vs_paged_decode": round((mark + check) * 1e3 / paged_ms, 6)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="context 1024 only, fewer rounds, no prefill")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per comparison")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--kv-heads", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--context", type=int, nargs="*", default=None)
    parser.add_argument("--dtype", nargs="*", default=None, help="default: float32 bfloat16 (cuda: bf16 fp16)")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth probe")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even when it imports")
    parser.add_argument("--no-torch-backend", action="store_true", help="skip the torch-backend comparison")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.rounds = args.rounds or (3 if args.quick else 5)
    dtypes = args.dtype or (["bfloat16", "float16"] if args.device.type == "cuda" else ["float32", "bfloat16"])
    if not args.no_bandwidth:
        for line in bandwidth(args.rounds, args.device):
            print(json.dumps(line), flush=True)
    paged_ms: dict[int, float] = {}
    for kv_heads in args.kv_heads:
        for context in args.context or ((1024,) if args.quick else (1024, 4096)):
            for dtype in dtypes:
                line = decode_case(kv_heads, context, getattr(torch, dtype), args)
                paged_ms.setdefault(context, line["ms"])
                print(json.dumps(line), flush=True)
    if args.device.type == "cpu":
        for context, ms in paged_ms.items():  # against the first decode case of each context
            print(json.dumps(written_check_case(context, ms, args.rounds)), flush=True)
    if args.quick or args.no_prefill:
        return
    for dtype in dtypes:
        for num_seqs, new_tokens, context in ((1, 2048, 2048), (8, 64, 1024)):
            print(json.dumps(prefill_case(num_seqs, new_tokens, context, getattr(torch, dtype), args)), flush=True)


if __name__ == "__main__":
    main()
