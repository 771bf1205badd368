"""The worker's kernels against dense attention, plus the pool layout and cache ops.

The reference is deliberately naive: it gathers each sequence's full K/V
history out of the pool token by token (through ``blockd.core.arith``, not the
kernels' index code) into contiguous tensors and computes
``softmax(Q K^T * scale + causal mask) V`` in float32.

Tolerances (kernel output vs the float32 reference on the same input values):

* float32: ``atol = rtol = 1e-4`` (observed errors are ~1e-6),
* bfloat16: ``atol = rtol = 2e-2`` (the output is rounded to bf16, ~4e-3
  relative; the kernel itself computes in float32),
* float16 (one smoke case): ``atol = rtol = 5e-3`` (fp16 rounds at ~5e-4).

Each grid runs on every backend of :class:`PagedAttention`: ``torch`` (the
tiled torch kernels), ``native`` (the compiled CPU kernel; its vector, 4-wide
and scalar code paths are checked separately) and ``flashinfer`` (CUDA; skips
when torch sees no GPU or flashinfer is not installed; bf16/fp16 only).
CUDA variants run the same checks on a GPU and skip when torch sees none.

The decoder layer's compiled elementwise ops (``csrc/layer_ops.cpp``) are
checked against their torch fallbacks in :mod:`worker.model.fused`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from blockd.core.arith import num_blocks_for, slot_mapping, slot_of
from worker.kernels import (
    PagedAttention,
    copy_blocks,
    flashinfer_attention,
    native,
    paged_decode_attention,
    paged_prefill_attention,
    select_device,
    write_kv,
)
from worker.layout import KVGeometry, allocate_kv_pool, as_rows, gather_rows, split_slots
from worker.model.fused import add_rms_norm_torch, layer_ops, rms_norm_torch, rotary_torch, silu_mul_torch

TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}
NUM_KV_HEADS = 2  # small: the grid is wide, and heads are independent anyway

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA path: needs a GPU, torch.cuda.is_available() is False"))
DEVICES = ["cpu", CUDA]
FLASHINFER = pytest.param("flashinfer", marks=pytest.mark.skipif(
    not flashinfer_attention.available(), reason="FlashInfer path: needs a CUDA GPU and flashinfer-python"))
BACKENDS = ["torch", "native", FLASHINFER]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These tensors are tiny: one thread is faster and immune to a busy shared CI host."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- helpers


def make_batch(ctx_lens, block_size, num_kv_heads, head_dim, dtype, device="cpu", seed=0,
               spare_blocks=3, table_pad=-1):
    """A random one-layer pool and shuffled, non-contiguous block tables for ``ctx_lens``."""
    gen = torch.Generator().manual_seed(seed)
    needed = [num_blocks_for(c, block_size) for c in ctx_lens]
    geometry = KVGeometry(1, sum(needed) + spare_blocks, block_size, num_kv_heads, head_dim)
    kv = allocate_kv_pool(geometry, dtype)
    kv.normal_(generator=gen)
    ids = torch.randperm(geometry.num_blocks, generator=gen).tolist()
    width = max(needed) + 1  # one padding column at least
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start:start + n] + [table_pad] * (width - n))
        start += n
    return kv.to(device), torch.tensor(tables, dtype=torch.int32, device=device)


def dense_reference(query, kv_layer, tables, ctx_lens, q_lens, scale):
    """Float32 ``[total_q, Hq, D]``: per sequence, contiguous K/V and an explicit causal softmax."""
    kv_layer, tables, query = kv_layer.cpu().float(), tables.cpu().tolist(), query.cpu().float()
    block_size, group = kv_layer.shape[3], query.shape[1] // kv_layer.shape[2]
    outputs, q_start = [], 0
    for table, ctx, q_len in zip(tables, ctx_lens, q_lens):
        slots = [slot_of(table, t, block_size) for t in range(ctx)]
        blocks, offsets = [s // block_size for s in slots], [s % block_size for s in slots]
        k = kv_layer[0][blocks, :, offsets].repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = kv_layer[1][blocks, :, offsets].repeat_interleave(group, dim=1)
        q = query[q_start:q_start + q_len]  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(ctx - q_len, ctx)  # the new tokens are the last q_len
        hidden = torch.arange(ctx)[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        q_start += q_len
    return torch.cat(outputs)


def check_close(actual, expected):
    torch.testing.assert_close(actual.cpu().float(), expected, **TOLERANCE[actual.dtype])


def run_attention(ctx_lens, q_lens, block_size, head_dim, ratio, dtype, device="cpu", tile_bytes=None,
                  decode_api=False, seed=0, bag_rows=None, backend="torch"):
    if backend == "flashinfer":
        if not flashinfer_attention.supports(dtype, head_dim):
            pytest.skip(f"FlashInfer has no kernels for {dtype} / head_dim {head_dim} (the torch kernels run)")
        device = "cuda"
    kv, tables = make_batch(ctx_lens, block_size, NUM_KV_HEADS, head_dim, dtype, device, seed)
    num_q_heads = NUM_KV_HEADS * ratio
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    context = torch.tensor(ctx_lens, dtype=torch.int64, device=device)
    scale = 1.0 / math.sqrt(head_dim)
    wrapper = PagedAttention(device=device, tile_bytes=tile_bytes, bag_rows=bag_rows, backend=backend)
    assert wrapper.backend == backend
    wrapper.plan(tables, context, None if decode_api else q_start, num_q_heads=num_q_heads,
                 num_kv_heads=NUM_KV_HEADS, head_dim=head_dim, block_size=block_size, kv_dtype=dtype,
                 scale=scale)
    actual = wrapper.run(query, kv[0])
    expected = dense_reference(query, kv[0], tables, ctx_lens, q_lens, scale)
    check_close(actual, expected)
    return wrapper


def edge_lengths(block_size):
    """1, b-1, b, b+1, several multiples of b (and one between), deduplicated, > 0."""
    b = block_size
    return sorted({n for n in (1, b - 1, b, b + 1, 2 * b, 3 * b, 5 * b + 3, 8 * b) if n > 0})


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 3, 4, 8])  # 3: SmolLM2's query heads per KV head
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_matches_dense(block_size, head_dim, ratio, dtype, backend):
    ctx = edge_lengths(block_size)
    run_attention(ctx, [1] * len(ctx), block_size, head_dim, ratio, dtype, decode_api=True, backend=backend)


@pytest.mark.parametrize("bag_rows", [0, None])
@pytest.mark.parametrize("tile_bytes", [1, 64 << 10, 1 << 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_long_context_any_tiling(dtype, tile_bytes, bag_rows):
    """~2000 tokens; tile sizes from one (seq, head) pair per tile to the whole batch in one;
    probs @ V by embedding_bag (the CPU default for decode) and by gather + bmm (bag_rows=0)."""
    ctx = [2000, 1999, 2049, 7, 16]
    wrapper = run_attention(ctx, [1] * len(ctx), 16, 128, 4, dtype, tile_bytes=tile_bytes, bag_rows=bag_rows)
    tiles = wrapper.plan_info.tiles
    if tile_bytes == 1:
        assert len(tiles) == len(ctx) * NUM_KV_HEADS
    assert all((t.bag_offset >= 0) == (bag_rows is None) for t in tiles)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_one_shot_function(device):
    ctx = [1, 15, 16, 17, 40]
    kv, tables = make_batch(ctx, 16, NUM_KV_HEADS, 64, torch.float32, device)
    query = torch.randn(len(ctx), 8, 64, device=device)
    out = paged_decode_attention(query, kv[0], tables, torch.tensor(ctx, device=device))
    check_close(out, dense_reference(query, kv[0], tables, ctx, [1] * len(ctx), 64 ** -0.5))


def test_table_padding_entries_are_ignored():
    """Entries past a sequence's blocks may hold anything, even ids beyond the pool."""
    ctx = [5, 40, 17]
    kv, tables = make_batch(ctx, 16, NUM_KV_HEADS, 64, torch.float32, table_pad=10**6)
    query = torch.randn(len(ctx), 4, 64)
    out = paged_decode_attention(query, kv[0], tables, torch.tensor(ctx), scale=0.3)
    check_close(out, dense_reference(query, kv[0], tables, ctx, [1] * len(ctx), 0.3))


# ---------------------------------------------------------------- prefill / extend / mixed


def mixed_batch(block_size):
    """(context_lens, q_lens): decode, full prefill, chunked prefill / prefix hit, aligned extend."""
    b = block_size
    pairs = [(1, 1), (b + 1, b + 1), (3 * b + 2, 5), (2 * b, 1), (5 * b, 2 * b), (7, 7), (b, 3)]
    pairs = [(c, min(q, c)) for c, q in pairs]
    return [c for c, _ in pairs], [q for _, q in pairs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_prefill_and_decode_match_dense(block_size, head_dim, ratio, dtype, backend):
    ctx, q_lens = mixed_batch(block_size)
    run_attention(ctx, q_lens, block_size, head_dim, ratio, dtype, backend=backend)


@pytest.mark.parametrize(("backend", "tile_bytes"), [("torch", 16 << 10), ("torch", None), ("native", None),
                                                 ("flashinfer", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prefill_and_extend(dtype, backend, tile_bytes):
    """~2000-token prompt, a 300-token chunk after a 1700-token prefix, and decodes.

    Small tiles force row chunks with causally trimmed key ranges and head splits.
    """
    if backend == "flashinfer" and not flashinfer_attention.available():
        pytest.skip("FlashInfer path: needs a CUDA GPU and flashinfer-python")
    ctx, q_lens = [2000, 2000, 33, 1], [2000, 300, 1, 1]
    wrapper = run_attention(ctx, q_lens, 16, 64, 4, dtype, tile_bytes=tile_bytes, backend=backend)
    if tile_bytes:
        tiles = wrapper.plan_info.tiles
        assert len({t.num_blocks for t in tiles}) > 2  # trimmed: early row chunks gather less


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_pool(backend):
    ctx, q_lens = mixed_batch(16)
    run_attention(ctx, q_lens, 16, 64, 4, torch.float16, backend=backend)


@pytest.mark.parametrize("bag_rows", [0, 10**6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_either_value_path(dtype, bag_rows):
    """Every tile's probs @ V by gather + bmm (0), or by embedding_bag even for long prefills."""
    ctx, q_lens = mixed_batch(16)
    wrapper = run_attention(ctx, q_lens, 16, 64, 4, dtype, bag_rows=bag_rows)
    assert all((t.bag_offset >= 0) == bool(bag_rows) for t in wrapper.plan_info.tiles)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_sequences_without_query_tokens(backend):
    ctx, q_lens = [20, 30, 9], [4, 0, 9]
    run_attention(ctx, q_lens, 16, 64, 2, torch.bfloat16 if backend == "flashinfer" else torch.float32,
                  backend=backend)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_strided_query_and_empty_sequences(backend):
    """A query that is a transposed view (as a model's projections hand it over) and a
    sequence with no tokens at all: the output is still contiguous and exact."""
    ctx, q_lens = [0, 40, 17], [0, 3, 1]
    kv, tables = make_batch([max(c, 1) for c in ctx], 16, NUM_KV_HEADS, 64, torch.float32)
    query = torch.randn(8, sum(q_lens), 64).transpose(0, 1)  # [T, Hq, D], not contiguous
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    wrapper = PagedAttention(device="cpu", backend=backend)
    wrapper.plan(tables, torch.tensor(ctx), starts, num_q_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=64,
                 block_size=16, kv_dtype=torch.float32)
    out = wrapper.run(query, kv[0])
    assert out.is_contiguous()
    check_close(out, dense_reference(query, kv[0], tables, ctx, q_lens, 64 ** -0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_one_shot_function(device):
    ctx, q_lens = mixed_batch(16)
    kv, tables = make_batch(ctx, 16, NUM_KV_HEADS, 64, torch.float32, device)
    query = torch.randn(sum(q_lens), 8, 64, device=device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=device)
    out = paged_prefill_attention(query, kv[0], starts, tables, torch.tensor(ctx, device=device))
    check_close(out, dense_reference(query, kv[0], tables, ctx, q_lens, 64 ** -0.5))


# ---------------------------------------------------------------- the compiled CPU kernel


def native_isas():
    """The compiled kernel's code paths this CPU can run (``avx2`` only where it was compiled in)."""
    native.load(required=True)
    best = int(native.ops().best_isa())
    return [name for name, value in native.ISAS.items() if name != "auto" and value <= best]


@pytest.mark.parametrize("head_dim", [128, 24, 36, 18])  # 16-wide (bf16 pairs), 8-wide, 4-wide, scalar only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_every_code_path_matches_dense(dtype, head_dim):
    """Each vector width of the compiled kernel (forced through its ``isa`` argument) on a
    mixed batch: decode, full and chunked prefill, GQA; head sizes that rule out wider vectors."""
    ctx, q_lens = mixed_batch(16)
    ctx, q_lens = [*ctx, 700], [*q_lens, 70]  # several 32-key chunks and 64-row items
    kv, tables = make_batch(ctx, 16, NUM_KV_HEADS, head_dim, dtype)
    query = torch.randn(sum(q_lens), 4 * NUM_KV_HEADS, head_dim).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    expected = dense_reference(query, kv[0], tables, ctx, q_lens, head_dim ** -0.5)
    for isa in native_isas():
        wrapper = PagedAttention(device="cpu", backend="native")
        wrapper.isa = native.ISAS[isa]
        wrapper.plan(tables, torch.tensor(ctx), starts, num_q_heads=4 * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS,
                     head_dim=head_dim, block_size=16, kv_dtype=dtype)
        check_close(wrapper.run(query, kv[0]), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_split_along_keys_matches_dense(dtype):
    """Two long sequences and more threads than (sequence, head) pairs: the plan splits each
    pair's keys into pieces (merged by log-sum-exp); short ones stay whole."""
    ctx = [3000, 1500, 20]
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        wrapper = run_attention(ctx, [1] * len(ctx), 16, 64, 4, dtype, backend="native")
    finally:
        torch.set_num_threads(before)
    merges = wrapper.plan_info.merges
    assert merges.shape[0] == 2 * NUM_KV_HEADS  # the two long sequences, each KV head
    assert set(merges[:, 0].tolist()) == {0, 1} and bool((merges[:, 3] >= 2).all())


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=240, check=False)


def test_native_falls_back_to_torch_without_a_compiler(tmp_path):
    """A failed build (here: no working C++ compiler, empty cache) leaves ``auto`` on the torch
    kernels, still correct, and makes ``native`` raise with the reason; in a fresh interpreter,
    as the build is attempted once per process."""
    code = (
        "import torch\n"
        "from worker.kernels import PagedAttention, native\n"
        "pa = PagedAttention('cpu')\n"
        "assert pa.backend == 'torch', pa.backend\n"
        "pa.plan(torch.tensor([[0]]), torch.tensor([3]), num_q_heads=2, num_kv_heads=1, head_dim=8,"
        " block_size=4, kv_dtype=torch.float32)\n"
        "kv = torch.zeros(2, 1, 1, 4, 8)\n"
        "kv[1, 0, 0, :3] = 2.0\n"
        "assert bool((pa.run(torch.randn(1, 2, 8), kv) == 2.0).all())\n"
        "try:\n"
        "    PagedAttention('cpu', backend='native')\n"
        "except native.KernelUnavailable as err:\n"
        "    print('raised:', str(err)[:80])\n"
    )
    done = _child(code, CXX="false", BLOCKD_KERNEL_CACHE=str(tmp_path), BLOCKD_ATTENTION_BACKEND="auto")
    assert done.returncode == 0, done.stderr
    assert "raised: the compiled CPU attention kernel could not be built" in done.stdout
    assert "using the torch kernels" in done.stderr  # the one warning, with its reason


def test_backend_setting_is_validated(monkeypatch):
    monkeypatch.setenv("BLOCKD_ATTENTION_BACKEND", "torch")
    assert PagedAttention("cpu").backend == "torch"
    monkeypatch.setenv("BLOCKD_ATTENTION_BACKEND", "fast")
    with pytest.raises(ValueError, match="BLOCKD_ATTENTION_BACKEND must be one of"):
        PagedAttention("cpu")
    monkeypatch.setenv("BLOCKD_ATTENTION_BACKEND", "auto")
    monkeypatch.setenv("BLOCKD_ATTENTION_ISA", "avx9")
    with pytest.raises(ValueError, match="BLOCKD_ATTENTION_ISA must be one of"):
        PagedAttention("cpu")
    with pytest.raises(ValueError, match="CUDA devices only"):
        PagedAttention("cpu", backend="flashinfer")


# ---------------------------------------------------------------- the fused layer ops

# (tokens, hidden, q heads, kv heads, head dim): a decode batch (one thread), a
# prefill (parallel chunks), a width that is not a multiple of the 16 partial sums
LAYER_SHAPES = [(64, 576, 9, 3, 64), (700, 576, 9, 3, 64), (3, 100, 4, 2, 10)]


@pytest.mark.parametrize(("tokens", "hidden", "q_heads", "kv_heads", "head_dim"), LAYER_SHAPES)
def test_compiled_layer_ops_match_torch(tokens, hidden, q_heads, kv_heads, head_dim):
    """The compiled RMSNorm, add + RMSNorm and RoPE (csrc/layer_ops.cpp) against
    their torch fallbacks (transformers' math): RoPE is bit-identical (the same
    roundings, no FMA contraction), the norms differ only by the order of the
    mean's sum (float32 rounding, ~1e-7 relative)."""
    ops = layer_ops(compiled=True)
    gen = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, hidden, generator=gen) * 3 for _ in range(2))
    weight = torch.rand(hidden, generator=gen) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-6)
    want_total, want_normed = add_rms_norm_torch(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want_normed, atol=1e-6, rtol=1e-5)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1) for f in (torch.cos, torch.sin))
    for got, want in zip(ops.rotary(qkv, cos, sin, q_heads, kv_heads),
                         rotary_torch(qkv, cos, sin, q_heads, kv_heads)):
        assert got.is_contiguous() and got.shape == want.shape
        assert torch.equal(got, want)


def test_compiled_residual_add_is_exact():
    ops = layer_ops(compiled=True)
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 64, 300):
        a, b = torch.randn(tokens, 576, generator=gen), torch.randn(tokens, 576, generator=gen)
        assert torch.equal(ops.add(a, b), a + b)
    with pytest.raises(RuntimeError, match="differ in shape"):
        ops.add(torch.randn(2, 4), torch.randn(2, 5))


def test_compiled_silu_mul_matches_torch():
    """SiLU-and-mul runs torch's own kernels (a decode batch in one OpenMP
    region over the rows, one row on the calling thread, a prefill through
    torch's own threads): the same floats as the torch fallback, also under
    inference mode, as the worker runs it (the region's threads need the
    caller's thread-local state)."""
    ops = layer_ops(compiled=True)
    gen = torch.Generator().manual_seed(7)
    for tokens, width in ((64, 3072), (1, 3072), (700, 3072), (3, 22)):
        gate_up = torch.randn(tokens, width, generator=gen) * 4
        with torch.inference_mode():
            inferred = ops.silu_mul(gate_up)
        got = ops.silu_mul(gate_up)
        assert got.shape == (tokens, width // 2) and got.is_contiguous()
        assert torch.equal(got, silu_mul_torch(gate_up)) and torch.equal(inferred, got)
    with pytest.raises(RuntimeError, match="even width"):
        ops.silu_mul(torch.randn(2, 5))


def test_compiled_argmax_rows_is_torchs_argmax():
    """The greedy pick (worker/sampling.py): torch's argmax exactly, over ties
    (the first maximum wins, also across vector lanes and in the tail), NaNs
    (the first NaN wins), rows of -inf, and widths that are not a multiple of 16."""
    ops = layer_ops(compiled=True)
    gen = torch.Generator().manual_seed(11)
    for rows, width in ((64, 49152), (5, 1), (7, 15), (9, 17), (33, 1000)):
        x = torch.randn(rows, width, generator=gen)
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
        x = torch.randint(-3, 3, (rows, width), generator=gen).float()  # many ties
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    x = torch.zeros(6, 100)
    x[0, 40] = x[0, 7] = 2.0  # a tie in two lanes
    x[1, 99] = x[1, 98] = 3.0  # a tie in the tail
    x[2, 50] = float("nan")
    x[2, 60] = 9.0
    x[3] = float("-inf")
    x[4, 20] = x[4, 90] = float("nan")
    x[5, 3] = -0.0
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    with pytest.raises(RuntimeError, match="at least one column"):
        ops.argmax_rows(torch.zeros(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_copy_rows_matches_index_copy(dtype):
    """The prepared step's K/V write: the compiled row copy equals index_copy_ and refuses rows past the end."""
    gen = torch.Generator().manual_seed(1)
    dst = torch.randn(50, 16, generator=gen).to(dtype)
    rows = torch.randperm(50, generator=gen)[:13]
    src = torch.randn(13, 16, generator=gen).to(dtype)
    want = dst.clone().index_copy_(0, rows, src)
    layer_ops(compiled=True).copy_rows(dst, rows, src)
    assert torch.equal(dst, want)
    with pytest.raises(RuntimeError, match="row 50 is outside"):
        layer_ops(compiled=True).copy_rows(dst, torch.tensor([3, 50]), src[:2])
    assert torch.equal(dst, want), "nothing is written when a row is refused"


def test_compiled_layer_ops_refuse_bad_input():
    ops = layer_ops(compiled=True)
    x = torch.randn(4, 8)
    for call, match in [
        (lambda: ops.rms_norm(x.t(), torch.ones(4), 1e-6), "contiguous float32"),
        (lambda: ops.rms_norm(x.double(), torch.ones(8), 1e-6), "contiguous float32"),
        (lambda: ops.rms_norm(x, torch.ones(7), 1e-6), "weight must be"),
        (lambda: ops.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6), "differ in shape"),
        (lambda: ops.rotary(torch.randn(4, 40), torch.ones(4, 8), torch.ones(4, 8), 2, 2), "q_heads \\+ 2 kv_heads"),
        (lambda: ops.rotary(torch.randn(4, 32), torch.ones(3, 8), torch.ones(3, 8), 2, 1), "cos and sin"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            call()


# ---------------------------------------------------------------- plan once, run per layer


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_plan_once_run_every_layer_reuses_workspace(backend):
    ctx, q_lens = mixed_batch(16)
    geometry = KVGeometry(3, 64, 16, NUM_KV_HEADS, 64)
    pool = allocate_kv_pool(geometry, torch.float32).normal_()
    _, tables = make_batch(ctx, 16, NUM_KV_HEADS, 64, torch.float32, spare_blocks=64)
    tables = torch.where(tables >= 0, tables % 64, tables)  # ids must fit this pool; collisions are fine
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    wrapper = PagedAttention(device="cpu", backend=backend)
    wrapper.plan(tables, torch.tensor(ctx), starts, num_q_heads=8, num_kv_heads=NUM_KV_HEADS, head_dim=64,
                 block_size=16, kv_dtype=torch.float32)
    workspace = wrapper.workspace_bytes
    out = torch.empty(sum(q_lens), 8, 64)
    for layer in range(geometry.num_layers):
        query = torch.randn(sum(q_lens), 8, 64)
        assert wrapper.run(query, pool[layer], out=out) is out
        check_close(out, dense_reference(query, pool[layer], tables, ctx, q_lens, 64 ** -0.5))
        assert wrapper.workspace_bytes == workspace
    # A smaller batch fits the existing buffers: workspaces only grow.
    wrapper.plan(tables[:2], torch.tensor(ctx[:2]), starts[:3], num_q_heads=8, num_kv_heads=NUM_KV_HEADS,
                 head_dim=64, block_size=16, kv_dtype=torch.float32)
    assert wrapper.workspace_bytes == workspace


def test_plan_rejects_inconsistent_batches():
    tables = torch.tensor([[0, 1], [2, -1]])
    kwargs = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "kv_dtype": torch.float32}
    wrapper = PagedAttention(device="cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        wrapper.plan(tables, torch.tensor([3, 3]), **{**kwargs, "num_q_heads": 3})
    with pytest.raises(ValueError, match=r"need 2 blocks, table has 2|need 3 blocks"):
        wrapper.plan(tables, torch.tensor([9, 3]), **kwargs)
    with pytest.raises(ValueError, match="negative block id"):
        wrapper.plan(tables, torch.tensor([3, 5]), **kwargs)
    with pytest.raises(ValueError, match=r"must be\s+>= its 4 query tokens"):
        wrapper.plan(tables, torch.tensor([3, 3]), torch.tensor([0, 4, 5]), **kwargs)
    with pytest.raises(ValueError, match="context_lens has 1 entries"):
        wrapper.plan(tables, torch.tensor([3]), **kwargs)
    with pytest.raises(ValueError, match="integers"):
        wrapper.plan(tables.float(), torch.tensor([3, 3]), **kwargs)
    with pytest.raises(ValueError, match="before plan"):
        PagedAttention(device="cpu").run(torch.zeros(2, 4, 8), torch.zeros(2, 3, 2, 4, 8))


def test_run_rejects_mismatched_tensors():
    wrapper = PagedAttention(device="cpu")
    wrapper.plan(torch.tensor([[0, 5]]), torch.tensor([6]), num_q_heads=4, num_kv_heads=2, head_dim=8,
                 block_size=4, kv_dtype=torch.float32)
    layer = torch.zeros(2, 6, 2, 4, 8)
    with pytest.raises(ValueError, match="query must be"):
        wrapper.run(torch.zeros(1, 2, 8), layer)
    with pytest.raises(ValueError, match="query must be"):
        wrapper.run(torch.zeros(1, 4, 8, dtype=torch.bfloat16), layer)
    with pytest.raises(ValueError, match="kv_layer must be"):
        wrapper.run(torch.zeros(1, 4, 8), torch.zeros(2, 6, 2, 8, 8))
    with pytest.raises(ValueError, match="name block 5, but the layer has 5 blocks"):
        wrapper.run(torch.zeros(1, 4, 8), torch.zeros(2, 5, 2, 4, 8))
    with pytest.raises(ValueError, match="out must be"):
        wrapper.run(torch.zeros(1, 4, 8), layer, out=torch.zeros(1, 4, 8, dtype=torch.float64))


# ---------------------------------------------------------------- write_kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_padding_slots(device, dtype):
    geometry = KVGeometry(1, 6, 4, 2, 8)
    kv = allocate_kv_pool(geometry, dtype, device)
    table = [5, 2, 0]
    slots = slot_mapping(table, 0, 10, 4)
    padded = torch.tensor([*slots[:4], -1, -1, *slots[4:], -1], dtype=torch.int32, device=device)
    key = torch.randn(len(padded), 2, 8, device=device).to(dtype)
    value = torch.randn(len(padded), 2, 8, device=device).to(dtype)
    write_kv(kv[0], key, value, padded)
    real = (padded >= 0).nonzero()[:, 0]
    expected = torch.zeros_like(kv)
    for row, slot in zip(real.tolist(), slots):
        block, offset = divmod(slot, 4)
        expected[0, 0, block, :, offset] = key[row]
        expected[0, 1, block, :, offset] = value[row]
    assert torch.equal(kv, expected)  # the padding rows were written nowhere


def test_write_kv_whole_pool_all_layers():
    geometry = KVGeometry(3, 5, 2, 2, 4)
    kv = allocate_kv_pool(geometry, torch.float32)
    slots = torch.tensor([7, -1, 0, 4])
    key, value = torch.randn(3, 4, 2, 4), torch.randn(3, 4, 2, 4)
    write_kv(kv, key, value, slots)
    for layer in range(3):
        for row, slot in ((0, 7), (2, 0), (3, 4)):
            block, offset = divmod(slot, 2)
            assert torch.equal(kv[layer, 0, block, :, offset], key[layer, row])
            assert torch.equal(kv[layer, 1, block, :, offset], value[layer, row])
    assert int((kv != 0).sum()) == 3 * 2 * 3 * 2 * 4  # exactly 3 slots x 3 layers x K,V written


def test_write_kv_rejects_bad_input():
    kv = allocate_kv_pool(KVGeometry(1, 2, 4, 2, 8), torch.float32)
    key = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="past the pool's 8 slots"):
        write_kv(kv[0], key, key, torch.tensor([0, 8, -1]))
    with pytest.raises(ValueError, match="cast it first"):
        write_kv(kv[0], key.double(), key.double(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="key must be"):
        write_kv(kv[0], torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv(kv[0], key, key, torch.tensor([0, 1]))


# ---------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_copies_every_layer_k_and_v(device):
    kv = allocate_kv_pool(KVGeometry(2, 6, 4, 2, 8), torch.float32, device).normal_()
    before = kv.clone()
    copy_blocks(kv, torch.tensor([[1, 4], [3, 0]], device=device))
    expected = before.clone()
    expected[:, :, 4], expected[:, :, 0] = before[:, :, 1], before[:, :, 3]
    assert torch.equal(kv, expected)


def test_copy_blocks_reads_all_sources_before_writing():
    kv = allocate_kv_pool(KVGeometry(1, 3, 2, 1, 4), torch.float32).normal_()
    before = kv.clone()
    copy_blocks(kv, torch.tensor([[0, 1], [1, 0]]))  # a swap
    assert torch.equal(kv[:, :, 0], before[:, :, 1]) and torch.equal(kv[:, :, 1], before[:, :, 0])


def test_copy_blocks_rejects_bad_pairs():
    kv = allocate_kv_pool(KVGeometry(1, 3, 2, 1, 4), torch.float32)
    with pytest.raises(ValueError, match="destinations must be distinct"):
        copy_blocks(kv, torch.tensor([[0, 2], [1, 2]]))
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 3\)"):
        copy_blocks(kv, torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="pairs must be"):
        copy_blocks(kv, torch.tensor([0, 1]))


# ---------------------------------------------------------------- layout and device


def test_pool_bytes_formula_and_row_view():
    geometry = KVGeometry(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=3, head_dim=8)
    kv = allocate_kv_pool(geometry, torch.bfloat16)
    assert kv.shape == (2, 2, 5, 3, 4, 8)
    assert geometry.pool_bytes(torch.bfloat16) == 5 * 4 * 2 * 2 * 3 * 8 * 2 == kv.numel() * kv.element_size()
    assert KVGeometry.of(kv) == geometry
    kv.normal_()
    rows = as_rows(kv[1, 0])
    row = gather_rows(torch.tensor(4), torch.tensor(2), 3)
    assert torch.equal(rows[row], kv[1, 0, 4, 2].reshape(-1))  # block 4, head 2: b x D contiguous


def test_split_slots_inverts_arith():
    table, block_size = [9, 3, 7], 4
    slots = torch.tensor([slot_of(table, t, block_size) for t in range(12)])
    blocks, offsets = split_slots(slots, block_size)
    assert blocks.tolist() == [table[t // block_size] for t in range(12)]
    assert offsets.tolist() == [t % block_size for t in range(12)]


def test_geometry_and_pool_validation():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        KVGeometry(1, 4, 0, 1, 8)
    with pytest.raises(ValueError, match="floating-point"):
        allocate_kv_pool(KVGeometry(1, 1, 1, 1, 1), torch.int8)
    with pytest.raises(ValueError, match="a KV pool is"):
        KVGeometry.of(torch.zeros(2, 3, 4))


def test_select_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device().type == expected
    assert select_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            select_device("cuda")
