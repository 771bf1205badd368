"""The model runner on a real pool: tiny Llama, Qwen2 and GPT-2 models whose
attention runs on the paged KV pool give the same logits as the same
Hugging Face model's own full-sequence forward (fp32, atol = rtol = 1e-4, and
the largest absolute difference below 1e-4; measured: about 1e-5 on logits of
magnitude up to ~7) and the same greedy tokens as its
``generate(do_sample=False)``.

One scenario drives every case like a small continuous-batching scheduler:
three prompts of different lengths (one prefilled in two chunks), a fork
whose first decode copies a shared block on write, a prefix-cache hit, and
decode steps until each sequence generated 9 tokens. It runs in process
(one runtime fed by a core Pool) and over gRPC against a tensor-parallel
pair of ``blockd-worker`` processes and a real ``blockd serve``.
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from blockd.core import Allocate, Commit, DecodeAppend, Fork, Pool
from blockd.core.errors import InvalidArgument, NotFound, WrongState
from blockd.core.incarnations import KVNotWritten
from client.errors import FailedPreconditionError, InvalidArgumentError
from client.sdk import BlockdClient
from client.worker import WorkerClient
from tests.support.procs import free_port, start_blockd, start_worker
from worker.kernels import native
from worker.model import ModelRunner, build_model, pool_config_for
from worker.model import compiled as compiled_module
from worker.model.linear import PackedLinear, matmul_available, pack, pack_linears, packed_linears, warm_matmuls
from worker.runtime import WorkerRuntime
from worker.service import WorkerServer

TOL = 1e-4
NEW_TOKENS = 9
BLOCK_SIZE = 4


def reference(spec: str):
    """The same weights (same seed), attending with transformers' own eager path."""
    model = build_model(spec, seed=0)
    model.set_attn_implementation("eager")
    return model


class Scenario:
    """Drives ``step`` (pool ops -> StepResult) and ``forward`` (one model step ->
    logits [batch, vocab]) and checks every step against ``ref``."""

    def __init__(self, step, forward, ref) -> None:
        self.step_pool, self.forward, self.ref = step, forward, ref
        self.vocab = ref.config.vocab_size
        self.seqs: dict[str, list[int]] = {}  # every token, prompt + generated
        self.prompt_lens: dict[str, int] = {}
        self.generated: dict[str, list[int]] = {}
        self.max_diff = 0.0

    def run(self, version, batch) -> None:
        """``batch``: (seq_id, context_len, query_len, slots) per sequence."""
        tokens = [t for s, n, q, _ in batch for t in self.seqs[s][n - q : n]]
        logits = self.forward(version, [b[0] for b in batch], [b[2] for b in batch], [b[1] for b in batch],
                              tokens, [slot for b in batch for slot in b[3]])
        for row, (seq_id, n, _, _) in enumerate(batch):
            with torch.no_grad():
                want = self.ref(torch.tensor([self.seqs[seq_id][:n]])).logits[0, -1]
            torch.testing.assert_close(logits[row], want, atol=TOL, rtol=TOL)
            self.max_diff = max(self.max_diff, float((logits[row] - want).abs().max()))
            if n == len(self.seqs[seq_id]):  # not a partial prefill chunk
                self.generated.setdefault(seq_id, []).append(int(logits[row].argmax()))

    def decode_ops(self, seq_ids):
        tokens = [self.generated[s][-1] for s in seq_ids]
        for seq_id, token in zip(seq_ids, tokens):
            self.seqs[seq_id].append(token)
        return DecodeAppend(list(seq_ids), tokens)

    def decode_batch(self, result, seq_ids, op_index):
        slots = result.results[op_index].slot_mapping
        return [(s, len(self.seqs[s]), 1, [slots[i]]) for i, s in enumerate(seq_ids)]

    def drive(self) -> None:
        gen = torch.Generator().manual_seed(7)
        prompts = {s: torch.randint(0, self.vocab, (n,), generator=gen).tolist()
                   for s, n in (("a", 11), ("b", 6), ("c", 17))}
        self.seqs = {s: list(p) for s, p in prompts.items()}
        r = self.step_pool([Allocate(s, p) for s, p in prompts.items()])
        slots = {s: list(res.slot_mapping) for s, res in zip(prompts, r.results)}
        # a and b prefill whole; c prefills its first 9 tokens (a chunk).
        self.run(r.version, [("a", 11, 11, slots["a"]), ("b", 6, 6, slots["b"]), ("c", 9, 9, slots["c"][:9])])
        # Fork a; the child's first token differs so the two diverge. Both append
        # into their shared, partly filled last block: copy on write.
        self.seqs["a2"] = list(self.seqs["a"])
        self.generated["a2"] = [(self.generated["a"][-1] + 1) % self.vocab]
        r = self.step_pool([Commit("c", 9), Fork("a", "a2"), self.decode_ops(["a", "a2", "b"])])
        assert r.copy_ops, "appending to a shared, partly filled block must copy it"
        self.run(r.version, [*self.decode_batch(r, ["a", "a2", "b"], 2), ("c", 17, 8, slots["c"][9:])])
        # d shares a's first two (committed, full) blocks: a prefix-cache hit.
        d_prompt = [*prompts["a"][:8], 1, 2, 3]
        self.seqs["d"] = list(d_prompt)
        running = ["a", "a2", "b", "c"]
        r = self.step_pool([self.decode_ops(running), Allocate("d", d_prompt)])
        assert r.results[1].num_cached_tokens == 8
        d_slots = list(r.results[1].slot_mapping)
        self.run(r.version, [*self.decode_batch(r, running, 0), ("d", 11, 3, d_slots)])
        prompts.update(a2=prompts["a"] + [self.generated["a2"][0]], d=d_prompt)
        self.generated["a2"] = self.generated["a2"][1:]  # the forced token is part of a2's prompt
        running.append("d")
        while min(len(self.generated[s]) for s in running) < NEW_TOKENS:
            r = self.step_pool([self.decode_ops(running)])
            self.run(r.version, self.decode_batch(r, running, 0))
        self.check_greedy(prompts)

    def check_greedy(self, prompts) -> None:
        for seq_id, prompt in prompts.items():
            with torch.no_grad():
                out = self.ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                        dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False,
                                        pad_token_id=0)
            assert self.generated[seq_id][:NEW_TOKENS] == out[0, len(prompt):].tolist(), seq_id


# --- in process ----------------------------------------------------------------

class Local:
    """A core Pool and one runtime following its deltas, with a model runner."""

    def __init__(self, spec: str, model=None, linear: str = "auto", device: str = "cpu", **runner) -> None:
        model = model if model is not None else build_model(spec, seed=0)
        self.config = pool_config_for(model.config, "m", num_blocks=64, block_size=BLOCK_SIZE)
        self.pool = Pool(self.config)
        self.runtime = WorkerRuntime(self.config, device=device, version_timeout_s=0.2,
                                     latest_committed=lambda: self.pool.version)
        self.runner = ModelRunner(model, self.runtime, linear=linear, **runner)

    def step(self, ops):
        result = self.pool.step(ops)
        for delta in self.pool.deltas_since(self.runtime.mirror.received_version):
            self.runtime.mirror.push(delta)
        return result


@pytest.mark.parametrize("linear", ["auto", "inner-product", "torch"])
@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_runner_matches_hf_logits_and_greedy_generate(spec, linear):
    """With the linear weights packed for oneDNN (the default on the CPU: its matmul
    where the oneDNN wheel is installed, else its inner product), for its inner
    product, and with plain nn.Linear."""
    local = Local(spec, linear=linear)
    linears = sum(type(m) in (nn.Linear, PackedLinear) for m in local.runner.model.modules())
    packed = linear != "torch"
    assert local.runner.packed_linears == (linears if packed else 0)
    if linear == "inner-product":
        assert all(m._packed.is_mkldnn for m in local.runner.model.modules() if isinstance(m, PackedLinear))
    expected = {"torch": "torch", "inner-product": "inner product",
                "auto": "matmul" if matmul_available() else "inner product"}[linear]
    assert local.runner.linear_kernel == expected
    # Llama and Qwen2 layers run fused on the packed path (GPT-2 keeps transformers' layers)
    assert local.runner.fused_layers == (2 if packed and spec != "tiny-gpt2" else 0)
    scenario = Scenario(local.step, local.runner.step, reference(spec))
    scenario.drive()
    assert scenario.max_diff < TOL


@pytest.mark.parametrize(("spec", "kernel"), [("tiny-llama", "mkl"), ("tiny-qwen2", "onednn")])
def test_compiled_decode_matches_hf_logits_and_greedy_generate(spec, kernel, tmp_path, monkeypatch):
    """Decode steps through the Inductor graph (worker.model.compiled), on MKL's
    packed GEMM and on oneDNN's, prefill eager: the same scenario, the same
    tolerance; the graph is warmed before the first step (every bucket: 4 and 8
    rows) and then serves steps of 2 to 8 sequences, padded to a bucket, without
    a recompile."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    local = Local(spec, compile_buckets=(4, 8), compile_kernel=kernel)
    compiled = local.runner.compiled
    assert compiled is not None and local.runner.not_compiled is None
    assert not compiled.applies([1] * 4), "before warm() every step runs eager"
    assert local.runner.warm() > 0 and compiled.kernels == {4: kernel, 8: kernel}
    assert set(compiled._packed) == ({4, 8} if kernel == "mkl" else set())
    forward, used = compiled.forward, []
    compiled.forward = lambda *args, **kw: (used.append(len(args[0].seq_ids)), forward(*args, **kw))[1]
    from torch._dynamo.utils import counters

    frames = counters["stats"]["unique_graphs"]
    scenario = Scenario(local.step, local.runner.step, reference(spec))
    scenario.drive()
    assert scenario.max_diff < TOL
    assert set(used) - {4, 8}, f"decode steps padded to a bucket ran compiled: {used}"
    assert counters["stats"]["unique_graphs"] == frames, "no step compiled a graph of its own"


def test_auto_keeps_for_each_bucket_the_code_its_timings_favour(tmp_path, monkeypatch):
    """``auto`` times eager and both graphs per bucket at warm-up and keeps the
    fastest, a graph only when it beats eager by the margin; steps of a bucket
    left eager run eager, and MKL's copies are dropped where not kept, never
    packed where they would pass the memory share. (The times are scripted: real
    ones on a tiny model are noise.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    times = {("eager", 4): 10.0, ("onednn", 4): 9.9, ("mkl", 4): 20.0,  # within the margin: eager
             ("eager", 8): 10.0, ("onednn", 8): 5.0, ("mkl", 8): 4.0,
             ("eager", 16): 10.0, ("onednn", 16): 5.0, ("mkl", 16): 6.0}

    def scripted(run):
        run()  # compiles, as the real timing's untimed call does
        kernel = run.args[4] if len(run.args) == 5 else "eager"
        return times[(kernel, len(run.args[1 if kernel != "eager" else 0]))]

    monkeypatch.setattr(compiled_module, "median_ms", scripted)
    monkeypatch.setattr(compiled_module.CompiledDecode, "_mkl_gemm_wins", lambda self, rows: True)
    local = Local("tiny-llama", compile_buckets=(4, 8, 16))
    compiled = local.runner.compiled
    local.runner.warm()
    assert compiled.kernels == {4: "eager", 8: "mkl", 16: "onednn"}
    assert set(compiled._packed) == {8}, "MKL's copies kept only where MKL runs"
    assert compiled.timings[8] == {"eager": 10.0, "onednn": 5.0, "mkl": 4.0}
    assert "8 rows: mkl (eager 10.0 ms, onednn 5.0 ms, mkl 4.0 ms)" in compiled.describe()
    assert [compiled.bucket(n) for n in (2, 3, 4, 5, 8, 9, 16, 17)] == [None, None, None, 8, 8, 16, 16, None]
    forward, used = compiled.forward, []
    compiled.forward = lambda *args, **kw: (used.append(len(args[0].seq_ids)), forward(*args, **kw))[1]
    scenario = Scenario(local.step, local.runner.step, reference("tiny-llama"))
    scenario.drive()
    assert scenario.max_diff < TOL
    assert used and set(used) <= set(range(5, 17)), used

    # no memory to spare: MKL is never packed nor timed
    monkeypatch.setattr(compiled_module, "available_memory", lambda: 0)
    local = Local("tiny-llama", compile_buckets=(8,))
    local.runner.warm()
    assert local.runner.compiled.kernels == {8: "onednn"} and "mkl" not in local.runner.compiled.timings[8]
    assert not local.runner.compiled._packed


def test_the_default_buckets_are_those_the_pool_can_fill():
    """A running sequence holds a block, so a pool of N blocks never sends a decode
    step of more than N rows; a bucket serves steps above half its rows and above
    the bucket below, and one no step can reach is not compiled."""
    from worker.main import COMPILE_BUCKETS, pool_buckets

    assert COMPILE_BUCKETS == (16, 32, 64, 128, 256)
    assert [pool_buckets(COMPILE_BUCKETS, n) for n in (7, 8, 16, 17, 64, 65, 129)] == [
        (), (16,), (16,), (16, 32), (16, 32, 64), (16, 32, 64, 128), COMPILE_BUCKETS]
    assert pool_buckets((4, 6, 100), 5) == (4, 6)  # 6 serves 5 and 6 rows


def test_a_refusal_inside_the_compiled_graph_reaches_the_caller_and_the_next_step_runs(tmp_path, monkeypatch):
    """A layer's attention refusing mid-step (the pool's incarnation changed) ends
    the compiled step with that error, never logits; the runner's batch slot is
    cleared, and the same step then runs and matches the eager runner's logits."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    local = Local("tiny-llama", compile_buckets=(4,), compile_kernel="mkl")
    eager = Local("tiny-llama")
    local.runner.warm()
    prompts = {f"s{i}": [3 + i, 5, 7] for i in range(3)}
    for runner_local in (local, eager):
        r = runner_local.step([Allocate(s, p) for s, p in prompts.items()])
        runner_local.runner.step(r.version, list(prompts), [3] * 3, [3] * 3, [t for p in prompts.values() for t in p],
                                 [x for res in r.results for x in res.slot_mapping])
    ops = [DecodeAppend(list(prompts), [9, 9, 9])]
    r, r_eager = local.step(ops), eager.step(ops)
    args = (list(prompts), [1] * 3, [4] * 3, [9] * 3)
    real, calls = local.runtime.step_attention, []

    def refuse_on_layer_1(step, layer, *rest):
        calls.append(layer)
        if layer == 1 and len(calls) < 3:
            raise WrongState("the pool incarnation changed during the step; plan it again")
        return real(step, layer, *rest)

    monkeypatch.setattr(local.runtime, "step_attention", refuse_on_layer_1)
    with pytest.raises(WrongState, match="incarnation changed"):
        local.runner.step(r.version, *args, list(r.results[0].slot_mapping))
    assert calls == [0, 1]
    assert local.runner.compiled.key in compiled_module._BATCHES
    assert compiled_module._BATCHES[local.runner.compiled.key] is None
    logits = local.runner.step(r.version, *args, list(r.results[0].slot_mapping))
    want = eager.runner.step(r_eager.version, *args, list(r_eager.results[0].slot_mapping))
    assert calls[2:] == [0, 1] and (logits - want).abs().max() < TOL


def test_the_compiled_decode_says_why_it_does_not_apply():
    why = Local("tiny-gpt2", compile_buckets=(4,)).runner.not_compiled
    assert why == "GPT2LMHeadModel is not one of LlamaForCausalLM, Qwen2ForCausalLM"
    assert Local("tiny-llama", linear="torch", compile_buckets=(4,)).runner.not_compiled.startswith(
        "not every decoder layer is fused")
    assert Local("tiny-llama").runner.compiled is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path: needs a GPU, torch.cuda.is_available() is False")
@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_runner_on_cuda_matches_hf_logits_and_greedy_generate(spec):
    """The same scenario with the pool and the model on the GPU (the reference stays on the CPU)."""
    local = Local(spec, device="cuda")
    assert next(local.runner.model.parameters()).device.type == "cuda"
    scenario = Scenario(local.step, lambda *args: local.runner.step(*args).cpu(), reference(spec))
    scenario.drive()
    assert scenario.max_diff < TOL


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
def test_fused_layers_with_the_torch_ops_keep_weights_and_hooks(spec, monkeypatch):
    """The fused layers on the torch fallback of their compiled ops (as where
    nothing compiles) match transformers too; fusing adds no state-dict entry,
    changes no weight, and o_proj's forward hook (tensor parallelism's
    all-reduce) still runs."""
    monkeypatch.setenv("BLOCKD_ATTENTION_BACKEND", "torch")
    model = build_model(spec, seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    local = Local(spec, model)
    assert local.runner.fused_layers == 2
    assert type(model.model.layers[0]).__name__.startswith("FusedLayer")
    assert model.model.layers[0]._ops.__name__ == "_TorchOps"
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    scenario = Scenario(local.step, local.runner.step, reference(spec))
    scenario.drive()
    assert scenario.max_diff < TOL
    assert seen


def test_packed_linears_keep_outputs_hooks_and_weights():
    """A packed layer computes nn.Linear's function (to float32 rounding) on any
    row count and shape, keeps its forward hooks (tensor parallelism's
    all-reduce hangs on them) and its state dict; bad settings are refused
    before the model is touched."""
    model = build_model("tiny-qwen2", seed=0)
    plain = dict(build_model("tiny-qwen2", seed=0).named_modules())
    seen = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = pool_config_for(model.config, "m", num_blocks=8, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="linear must be one of"):
        ModelRunner(model, WorkerRuntime(config, device="cpu"), linear="mkl")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the LM head
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            for shape in ((1, module.in_features), (7, module.in_features), (2, 5, module.in_features)):
                x = torch.randn(shape)
                with torch.no_grad():
                    torch.testing.assert_close(module(x), plain[name](x), atol=1e-5, rtol=1e-5)
    assert seen, "the forward hook still runs"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="float32 weights on the CPU"):
        pack_linears(build_model("tiny-llama", dtype="bfloat16"))


def test_onednn_matmul_packs_and_computes_nn_linear(monkeypatch):
    """oneDNN's matmul library (worker/kernels/csrc/onednn_matmul.cpp): nn.Linear's
    function with and without a bias, on 1 to 600 rows (past 256 the rows go in
    pieces) and on a 3-D input; bad input is refused with a message; without
    the library packing falls back to torch's inner product, which the same
    PackedLinear runs."""
    if not matmul_available():
        if os.environ.get("BLOCKD_REQUIRE_ONEDNN") == "1":
            pytest.fail(f"BLOCKD_REQUIRE_ONEDNN=1 but oneDNN's matmul did not load: {native.matmul_failure()}")
        pytest.skip(f"oneDNN's matmul is unavailable here: {native.matmul_failure()}")
    gen = torch.Generator().manual_seed(5)
    for bias in (False, True):
        plain = nn.Linear(96, 40, bias=bias)
        packed = pack(copy.deepcopy(plain), matmul=True)
        assert not packed._packed.is_mkldnn
        for shape in ((1, 96), (7, 96), (256, 96), (257, 96), (600, 96), (3, 5, 96)):
            x = torch.randn(shape, generator=gen)
            with torch.no_grad():
                torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
    ops = native.matmul_ops()
    weight = torch.randn(40, 96, generator=gen)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        ops.pack(weight.double())
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        ops.run(torch.randn(3, 96, dtype=torch.float64), ops.pack(weight), None, 40)
    with pytest.raises(RuntimeError, match="packed by blockd_matmul::pack"):
        ops.run(torch.randn(3, 96), torch.zeros(10), None, 40)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.run(torch.randn(3, 96), ops.pack(weight), torch.zeros(41), 40)
    assert ops.version() >= 30200
    with pytest.raises(RuntimeError, match="needs a weight shape"):
        ops.warm(0, 96, False)
    # a worker builds every row count's primitives at start: the fused layers' joined
    # projections (unregistered attributes) count too
    runner = Local("tiny-llama").runner
    fused = runner.model.model.layers[0]
    assert fused._qkv in packed_linears(runner.model) and runner.linear_kernel == "matmul"
    shapes = {(m.out_features, m.in_features) for m in packed_linears(runner.model)}
    assert warm_matmuls(runner.model) == len(shapes) >= 4
    monkeypatch.setattr(native, "_matmul_loaded", False)
    model = build_model("tiny-llama", seed=0)
    pack_linears(model)
    assert all(m._packed.is_mkldnn for m in model.modules() if isinstance(m, PackedLinear))


def test_runs_a_model_loaded_from_a_local_directory(tmp_path):
    saved = build_model("tiny-llama", seed=3)
    saved.save_pretrained(tmp_path)
    local = Local("", build_model(str(tmp_path)))
    prompt = [5, 6, 7, 8, 9, 10]
    r = local.step([Allocate("a", prompt)])
    logits = local.runner.step(r.version, ["a"], [6], [6], prompt, list(r.results[0].slot_mapping))
    saved.set_attn_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(logits[0], saved(torch.tensor([prompt])).logits[0, -1], atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="local model directory"):
        build_model(str(tmp_path / "missing"))


def test_runner_refuses_bad_steps_before_running():
    local = Local("tiny-llama")
    r = local.step([Allocate("a", [1, 2, 3, 4, 5])])
    slots = list(r.results[0].slot_mapping)
    step = local.runner.step
    with pytest.raises(InvalidArgument, match="vocabulary"):
        step(r.version, ["a"], [5], [5], [1, 2, 3, 4, 512], slots)
    with pytest.raises(InvalidArgument, match="sum"):
        step(r.version, ["a"], [5], [5], [1, 2, 3, 4], slots)
    with pytest.raises(InvalidArgument, match="one entry per sequence"):
        step(r.version, ["a"], [5, 1], [5], [1, 2, 3, 4, 5], slots)
    with pytest.raises(InvalidArgument, match="not its slots"):
        step(r.version, ["a"], [5], [5], [1, 2, 3, 4, 5], slots[::-1])
    with pytest.raises(NotFound):
        step(r.version, ["ghost"], [5], [5], [1, 2, 3, 4, 5], slots)
    step(r.version, ["a"], [5], [5], [1, 2, 3, 4, 5], slots)
    r2 = local.step([Allocate("b", [1])])
    step(r2.version, ["b"], [1], [1], [1], list(r2.results[0].slot_mapping))
    with pytest.raises(WrongState, match="stale"):
        step(r.version, ["a"], [5], [5], [1, 2, 3, 4, 5], slots)
    with pytest.raises(WrongState, match="never committed"):
        step(r2.version + 5, ["b"], [1], [1], [1], list(r2.results[0].slot_mapping))
    with pytest.raises(ValueError, match="needs"):  # GPT-2's 8 KV heads do not fit a 2-head pool
        ModelRunner(build_model("tiny-gpt2"), local.runtime)


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
def test_a_step_copies_context_from_another_prompts_new_tokens(spec):
    """``b`` agrees with ``a`` through 10 tokens: it shares ``a``'s two full
    blocks (``share_seq_id``) and copies the K/V of tokens 8 and 9 from ``a``'s
    new tokens of the same step (``copy_lens``), computing only its last token.
    Its logits, and those of its next decode step (which reads the copies),
    are the reference model's; without the copy the step is refused, as its
    context is not written; a copy reaching before the block of its first new
    token (where cached blocks other sequences read may be) or of positions the
    source does not compute now is INVALID_ARGUMENT, and neither changes anything."""
    local, ref = Local(spec), reference(spec)
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(0, ref.config.vocab_size, (11,), generator=gen).tolist()
    b = [*a[:10], (a[10] + 1) % ref.config.vocab_size]
    r = local.step([Allocate("a", a), Allocate("b", b, share_seq_id="a", share_tokens=10)])
    assert r.results[1].num_cached_tokens == 8
    slots_a, slots_b = list(r.results[0].slot_mapping), list(r.results[1].slot_mapping)
    step = local.runner.step
    with pytest.raises(KVNotWritten):
        step(r.version, ["a", "b"], [11, 1], [11, 11], [*a, b[10]], [*slots_a, slots_b[2]])
    for (lens, sources), why in (([0, 2], [1, 1]), "another sequence"), (([0, 2], [0]), "one entry per"), \
            (([11, 0], [1, 0]), "reach before"), (([0, 3], [0, 0]), "reach before"):
        with pytest.raises(InvalidArgument, match=why):
            step(r.version, ["a", "b"], [11, 1], [11, 11], [*a, b[10]], [*slots_a, slots_b[2]],
                 copy_lens=lens, copy_from=sources)
    with pytest.raises(InvalidArgument, match="not new tokens"):  # a computes only its last token here
        step(r.version, ["a", "b"], [1, 1], [11, 11], [a[10], b[10]], [slots_a[10], slots_b[2]],
             copy_lens=[0, 2], copy_from=[0, 0])
    logits = step(r.version, ["a", "b"], [11, 1], [11, 11], [*a, b[10]], [*slots_a, slots_b[2]],
                  copy_lens=[0, 2], copy_from=[0, 0])
    with torch.no_grad():
        for row, prompt in enumerate((a, b)):
            torch.testing.assert_close(logits[row], ref(torch.tensor([prompt])).logits[0, -1], atol=TOL, rtol=TOL)
    nxt = int(logits[1].argmax())
    r = local.step([Commit("a", 11), Commit("b", 11), DecodeAppend(["b"], [nxt])])
    logits = step(r.version, ["b"], [1], [12], [nxt], list(r.results[2].slot_mapping))
    with torch.no_grad():
        torch.testing.assert_close(logits[0], ref(torch.tensor([[*b, nxt]])).logits[0, -1], atol=TOL, rtol=TOL)


def test_a_restarted_worker_refuses_steps_over_kv_it_lost():
    """A new runtime (the worker after a restart) rebuilt from the same pool holds
    the tables but none of the KV: a step whose cached context it never wrote is
    refused before the model runs, naming the sequence; a fresh prompt runs."""
    model = build_model("tiny-llama", seed=0)
    local = Local("", model)
    r = local.step([Allocate("a", [1, 2, 3, 4, 5])])
    local.runner.step(r.version, ["a"], [5], [5], [1, 2, 3, 4, 5], list(r.results[0].slot_mapping))
    restarted = WorkerRuntime(local.config, device="cpu", version_timeout_s=0.2,
                              latest_committed=lambda: local.pool.version)
    runner = ModelRunner(model, restarted)
    assert restarted.incarnation != local.runtime.incarnation
    r = local.step([DecodeAppend(["a"], [6]), Allocate("b", [7, 8])])
    for delta in local.pool.deltas_since(0):
        restarted.mirror.push(delta)
    with pytest.raises(KVNotWritten, match=r"sequence .a. reads .*positions 0..4 of its 5"):
        runner.step(r.version, ["a"], [1], [6], [6], list(r.results[0].slot_mapping))
    runner.step(r.version, ["b"], [2], [2], [7, 8], list(r.results[1].slot_mapping))


def test_model_step_without_a_model_is_failed_precondition():
    local = Local("tiny-llama")
    server = WorkerServer(local.runtime, "w")
    server.start()
    try:
        with WorkerClient(server.address, timeout_s=10) as worker, \
                pytest.raises(FailedPreconditionError, match="runs no model"):
            worker.model_step("m", 0, ["a"], [1], [1], [1], [0], pool_incarnation="any")
    finally:
        server.stop(0)


def test_a_model_step_planned_on_a_term_the_worker_has_not_followed_is_refused():
    """ModelStep (and WriteKV, Attention) names the leader term of its Step response (a replicated
    blockd): a worker whose Watch has not been served in that term yet waits for it, then refuses,
    TERM_NOT_SEEN, before anything else is checked or run (its tables may still be an older leader's)."""
    local = Local("tiny-llama")
    local.runtime.version_timeout_s = 0.3
    local.runtime.mirror.note_term(4)
    server = WorkerServer(local.runtime, "w")
    server.start()
    try:
        with WorkerClient(server.address, timeout_s=10) as worker:
            with pytest.raises(FailedPreconditionError, match="planned on leader term 5") as info:
                worker.model_step("m", 0, ["a"], [1], [1], [1], [0], pool_incarnation="any", term=5)
            assert info.value.reason == "TERM_NOT_SEEN"
            rows = torch.zeros(1, local.config.num_kv_heads, local.config.head_dim)
            with pytest.raises(FailedPreconditionError, match="planned on leader term 5"):
                worker.write_kv("m", 0, 0, rows, rows, [0], pool_incarnation="any", term=5)
            query = torch.zeros(1, 4, local.config.head_dim)
            with pytest.raises(FailedPreconditionError, match="planned on leader term 5"):
                worker.attention("m", 0, 0, ["a"], [1], [1], query, pool_incarnation="any", term=5)
            with pytest.raises(FailedPreconditionError, match="runs no model"):  # its own term: on to the model
                worker.model_step("m", 0, ["a"], [1], [1], [1], [0], pool_incarnation="any", term=4)
    finally:
        server.stop(0)


# --- a tensor-parallel pair over gRPC ----------------------------------------------

class TPCluster:
    """The test as a minimal scheduler: blockd for the tables, both ranks for each step."""

    def __init__(self, blockd: BlockdClient, workers: list[WorkerClient]) -> None:
        self.blockd, self.workers = blockd, workers
        self.calls = ThreadPoolExecutor(len(workers))
        self.incarnation = ""

    def step(self, ops):
        result = self.blockd.step("m", ops)
        self.incarnation = result.incarnation
        return result

    def model_step(self, *args):
        futures = [self.calls.submit(w.model_step, "m", *args, return_logits=True, pool_incarnation=self.incarnation)
                   for w in self.workers]
        results = [f.result() for f in futures]
        (tokens0, logits0), (tokens1, logits1) = results
        assert tokens0 == tokens1 == logits0.argmax(-1).tolist()
        assert torch.equal(logits0, logits1), "TP ranks must return identical logits"
        return logits0

    def refusals(self, *args) -> list[Exception]:
        futures = [self.calls.submit(w.model_step, "m", *args, pool_incarnation=self.incarnation)
                   for w in self.workers]
        return [f.exception() for f in futures]


def _start_tp_pair(target: str, spec: str):
    init = f"tcp://127.0.0.1:{free_port()}"

    def start(rank):
        # Both at once: each rank blocks at start until its peer joined.
        return start_worker(target, "m", "--device", "cpu", "--worker-id", f"rank{rank}", "--model", spec,
                            "--tp-world-size", "2", "--tp-rank", str(rank), "--tp-init", init)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, rank) for rank in (0, 1)]
        return [f.result() for f in futures]


@pytest.mark.parametrize("spec", ["tiny-qwen2", "tiny-gpt2"])
def test_tensor_parallel_pair_matches_single_model(spec):
    ref = reference(spec)
    procs = [start_blockd()]
    try:
        with BlockdClient(procs[0].address, timeout_s=10) as blockd:
            blockd.create_pool(pool_config_for(ref.config, "m", num_blocks=64, block_size=BLOCK_SIZE))
            procs += _start_tp_pair(procs[0].address, spec)
            workers = [WorkerClient(p.address, timeout_s=30) for p in procs[1:]]
            half = pool_config_for(ref.config, "m", 1, 1).num_kv_heads // 2  # each rank derives its half
            assert [(w.stats().kv_head_start, w.stats().kv_head_end) for w in workers] == [(0, half),
                                                                                          (half, 2 * half)]
            cluster = TPCluster(blockd, workers)
            scenario = Scenario(cluster.step, cluster.model_step, ref)
            scenario.drive()
            assert scenario.max_diff < TOL
            version = blockd.get_pool("m").version
            bad = cluster.refusals(version - 1, ["a"], [1], [len(scenario.seqs["a"])], [1], [0])
            assert all(isinstance(e, FailedPreconditionError) and "stale" in str(e) for e in bad), bad
            bad = cluster.refusals(version, ["a"], [1], [len(scenario.seqs["a"])], [10**6], [0])
            assert all(isinstance(e, InvalidArgumentError) for e in bad), bad
            r = blockd.step("m", [scenario.decode_ops(["a"])])  # the pair still steps together
            scenario.run(r.version, scenario.decode_batch(r, ["a"], 0))
            for w in workers:
                w.close()
        with ThreadPoolExecutor(2) as stopping:  # in parallel: each takes seconds to stop
            codes = list(stopping.map(lambda p: p.stop(), procs[1:]))
        assert codes == [0, 0], procs[1].output()[-2000:] + procs[2].output()[-2000:]
    finally:
        for proc in reversed(procs):
            proc.kill()
