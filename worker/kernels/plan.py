"""Host-side planning of one batch of paged attention: tiles and gather indices.

Planning runs once per batch (per scheduler step) and is shared by every
layer; :mod:`worker.kernels.attention` then runs the plan per layer. A plan
cuts the batch into *tiles*. A tile is a grid of sequences x KV heads that
share a query-row count ``m`` and a gathered key count ``T = num_blocks * b``::

    tile = seqs [s0, s1, ...] x heads [h0, h1)  ->  pairs (seq, head), seq-major
    per pair: queries  [m * g, D]   (m query tokens x g = Hq / Hkv query heads)
              keys     [T, D]       (the pair's blocks 0 .. num_blocks-1, gathered)
              scores   [m * g, T]   (+ bias [m, T]: 0 = visible, -inf = masked)

Tiles are sized so one tile's gathered K stays under ``tile_bytes`` (a CPU's
last-level cache; see :mod:`worker.kernels.device`), which is what makes the
gather nearly free on a CPU: the matmul reads it back from cache. Decode
sequences (one query token) are sorted by length and packed many to a tile,
so padding to the tile's longest sequence wastes at most a quarter; a sequence
with several query tokens (prefill, chunked prefill, prefix-cache hit) gets
tiles of its own, cut by query rows, and each row chunk gathers only the
blocks its last row may see (causal trimming).

For tiles with few query rows per pair (decode), ``probs @ V`` needs no V
tile: one ``embedding_bag`` weighs the values straight out of the pool (its
kernel prefetches the scattered rows, about twice as fast as gathering them
first; see :mod:`worker.kernels.attention`). The plan stores the per-key
value rows and bag starts that call needs.

Causality: a sequence with ``ctx`` context tokens and ``q_len`` new tokens
has its new tokens at positions ``ctx - q_len .. ctx - 1``::

    positions:  0 1 2 ... ctx-q_len-1 | ctx-q_len ... ctx-1
                cached (prefix hit,   | new: query rows 0 .. q_len-1
                earlier chunks)       |
    query row r sees keys 0 .. ctx - q_len + r

Keys past that (including padding up to the tile's ``T``) get bias ``-inf``.

Gathered rows index the layer viewed by :func:`worker.layout.as_rows`. Padded
block columns repeat the sequence's first block, so every gathered key is a
finite value of the pool (never an out-of-range read).

Imports torch and :mod:`blockd.core.arith` / :mod:`worker.layout` / :mod:`worker.kernels.batch` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockd.core.arith import num_blocks_for
from worker.kernels.batch import Batch, PlanShape
from worker.layout import gather_rows, token_rows

__all__ = ["AttentionPlan", "Tile", "build_plan"]

# A decode tile stops taking (shorter) sequences once their block count
# falls under this fraction of its first one: padding waste <= 25%.
_MIN_FILL_NUM, _MIN_FILL_DEN = 3, 4
# Tiles are computed in float32 (see worker.kernels.attention).
_COMPUTE_BYTES = 4


@dataclass(frozen=True)
class Tile:
    """One tile; offsets index the flat tensors of its :class:`AttentionPlan`."""

    num_seqs: int
    num_heads: int
    q_rows: int  # query tokens per sequence (m)
    num_blocks: int  # blocks gathered per (seq, head) pair
    kv_offset: int  # start in ``AttentionPlan.kv_rows``
    q_offset: int  # start in ``AttentionPlan.q_rows``
    bias_offset: int  # start in ``AttentionPlan.bias``, or -1 when nothing is masked
    bag_offset: int  # start in ``AttentionPlan.bag_rows``, or -1: ``probs @ V`` is gather + bmm
    bag_starts_offset: int  # start in ``AttentionPlan.bag_starts`` (when ``bag_offset >= 0``)

    @property
    def num_pairs(self) -> int:
        return self.num_seqs * self.num_heads


@dataclass
class AttentionPlan(PlanShape):
    """Everything :meth:`PagedAttention.run` needs, already on the run device.

    * ``kv_rows``: int64 ``[sum of pairs * num_blocks]`` rows of ``as_rows(kv_layer[0 or 1])``.
    * ``q_rows``: int64 ``[total_q * Hkv]``, a permutation of the rows of
      ``query.view(total_q * Hkv, g * D)`` (row ``token * Hkv + head``) in tile order.
    * ``inverse_q_rows``: int64 ``[total_q * Hkv]``, ``q_rows``'s inverse permutation.
    * ``bias``: float32 ``[sum of masked tiles' seqs * m * T]``, 0 or ``-inf``.
    * ``bag_rows``: int32/int64 ``[sum of bag tiles' pairs * m * g * T]``, for tiles
      whose ``probs @ V`` runs as ``embedding_bag``: the row of every key's value
      in :func:`worker.layout.as_token_rows` of ``kv_layer[1]``, repeated for
      each of the pair's ``m * g`` query rows (one bag each).
    * ``bag_starts``: same dtype, ``[sum of bag tiles' pairs * m * g]``, each
      bag's start within its tile's ``bag_rows`` slice (``embedding_bag`` offsets).
    """

    tiles: list[Tile]
    kv_rows: torch.Tensor
    q_rows: torch.Tensor
    inverse_q_rows: torch.Tensor
    bias: torch.Tensor
    bag_rows: torch.Tensor
    bag_starts: torch.Tensor
    max_kv_elems: int = field(default=0)  # largest tile's gathered K, in elements
    max_v_elems: int = field(default=0)  # largest gathered V of a bmm (not bag) tile
    max_score_elems: int = field(default=0)  # largest tile's scores, in elements


class _PlanBuilder:
    """Accumulates tiles and their index tensors (on the CPU) for one batch."""

    def __init__(self, batch: Batch, num_kv_heads: int, head_dim: int, block_size: int,
                 group_size: int, tile_bytes: int, max_bag_rows: int) -> None:
        self.batch = batch
        self.heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.group, self.tile_bytes, self.max_bag_rows = group_size, tile_bytes, max_bag_rows
        self.tiles: list[Tile] = []
        self.kv_parts: list[torch.Tensor] = []
        self.q_parts: list[torch.Tensor] = []
        self.bias_parts: list[torch.Tensor] = []
        self.bag_parts: list[torch.Tensor] = []
        self.bag_start_parts: list[torch.Tensor] = []
        self.kv_len = self.q_len = self.bias_len = self.bag_len = self.bag_starts_len = 0
        # embedding_bag takes int32 indices (half the bytes) whenever the value rows fit.
        value_rows = (batch.max_block_id + 1) * num_kv_heads * block_size
        self.bag_dtype = torch.int32 if value_rows < 2**31 else torch.int64
        self.max_kv_elems = self.max_v_elems = self.max_score_elems = 0

    def pair_bytes(self, num_tokens: int) -> int:
        """Float32 bytes of the K tile one (sequence, head) pair needs for ``num_tokens`` keys.

        Counted at float32 whatever the pool's dtype, because bf16/fp16 tiles
        are widened to float32 before the matmuls and that copy is the larger
        one that has to stay in cache.
        """
        return num_blocks_for(num_tokens, self.block_size) * self.block_size * self.head_dim * _COMPUTE_BYTES

    def add_decode_tiles(self) -> None:
        """Pack the one-query-token sequences, longest first, into tiles."""
        ctx = self.batch.ctx
        order = sorted((i for i, n in enumerate(self.batch.q_len) if n == 1), key=lambda i: -ctx[i])
        i = 0
        while i < len(order):
            first = order[i]
            per_pair = self.pair_bytes(ctx[first])
            if self.heads * per_pair > self.tile_bytes:  # one sequence alone is too big: split heads
                self._add_head_split([first], 0, 1, num_blocks_for(ctx[first], self.block_size), per_pair)
                i += 1
                continue
            seqs = [first]
            for nxt in order[i + 1:]:
                fits = (len(seqs) + 1) * self.heads * per_pair <= self.tile_bytes
                if not fits or _MIN_FILL_DEN * self.pair_bytes(ctx[nxt]) < _MIN_FILL_NUM * per_pair:
                    break
                seqs.append(nxt)
            self.add_tile(seqs, 0, self.heads, 0, 1, num_blocks_for(ctx[first], self.block_size))
            i += len(seqs)

    def add_extend_tiles(self, seq: int) -> None:
        """Tiles of one multi-token sequence: row chunks x head ranges, causally trimmed."""
        ctx, q_len = self.batch.ctx[seq], self.batch.q_len[seq]
        per_pair = self.pair_bytes(ctx)
        heads_per_tile = max(1, min(self.heads, self.tile_bytes // per_pair))
        keys = num_blocks_for(ctx, self.block_size) * self.block_size
        # Scores are float32 [heads, rows * g, keys]: keep them within the same budget.
        rows = max(1, min(q_len, self.tile_bytes // (heads_per_tile * self.group * keys * 4)))
        for row_lo in range(0, q_len, rows):
            m = min(rows, q_len - row_lo)
            last_visible = ctx - q_len + row_lo + m  # keys the chunk's last row may see
            num_blocks = num_blocks_for(last_visible, self.block_size)
            self._add_head_split([seq], row_lo, m, num_blocks, per_pair, heads_per_tile)

    def _add_head_split(self, seqs, row_lo, m, num_blocks, per_pair, step=None) -> None:
        step = step or max(1, self.tile_bytes // per_pair)
        for lo in range(0, self.heads, step):
            self.add_tile(seqs, lo, min(lo + step, self.heads), row_lo, m, num_blocks)

    def add_tile(self, seqs: list[int], head_lo: int, head_hi: int, row_lo: int, m: int,
                 num_blocks: int) -> None:
        """Append one tile: its gather rows, query rows and (if anything is masked) bias."""
        b, batch = self.block_size, self.batch
        seq_t = torch.tensor(seqs, dtype=torch.int64)
        heads = torch.arange(head_lo, head_hi, dtype=torch.int64)
        # Padded columns repeat block column 0: a real, finite block of the same sequence.
        owned = torch.tensor([num_blocks_for(batch.ctx[s], b) for s in seqs], dtype=torch.int64)
        cols = torch.arange(num_blocks, dtype=torch.int64)
        cols = torch.where(cols[None, :] < owned[:, None], cols[None, :], 0)
        blocks = batch.tables[seq_t[:, None], cols]  # [n_seq, num_blocks]
        kv_rows = gather_rows(blocks[:, None, :], heads[None, :, None], self.heads)
        tokens = torch.tensor([batch.q_start[s] + row_lo for s in seqs], dtype=torch.int64)
        tokens = tokens[:, None] + torch.arange(m, dtype=torch.int64)[None, :]  # [n_seq, m]
        q_rows = tokens[:, None, :] * self.heads + heads[None, :, None]  # [n_seq, n_heads, m]
        bias_offset = self._add_bias(seqs, row_lo, m, num_blocks * b)
        bag_offset, bag_starts_offset = self._add_bags(kv_rows, m)
        self.tiles.append(Tile(len(seqs), len(heads), m, num_blocks, self.kv_len, self.q_len, bias_offset,
                               bag_offset, bag_starts_offset))
        self.kv_parts.append(kv_rows.reshape(-1))
        self.q_parts.append(q_rows.reshape(-1))
        self.kv_len += kv_rows.numel()
        self.q_len += q_rows.numel()
        pairs, keys = len(seqs) * len(heads), num_blocks * b
        self.max_kv_elems = max(self.max_kv_elems, pairs * keys * self.head_dim)
        if bag_offset < 0:
            self.max_v_elems = max(self.max_v_elems, pairs * keys * self.head_dim)
        self.max_score_elems = max(self.max_score_elems, pairs * m * self.group * keys)

    def _add_bags(self, kv_rows: torch.Tensor, m: int) -> tuple[int, int]:
        """Bag indices for ``probs @ V`` as one ``embedding_bag``; ``(-1, -1)`` for bmm tiles.

        Worth it only for few query rows per pair: a bag re-reads its pair's
        values once per query row, where a bmm reads the gathered tile once.
        """
        height = m * self.group
        if height > self.max_bag_rows:
            return -1, -1
        pairs = kv_rows.shape[0] * kv_rows.shape[1]
        tokens = token_rows(kv_rows.reshape(pairs, -1), self.block_size).reshape(pairs, 1, -1)
        keys = tokens.shape[2]
        rows = tokens.to(self.bag_dtype).expand(pairs, height, keys).reshape(-1)
        starts = torch.arange(0, pairs * height * keys, keys, dtype=self.bag_dtype)
        offsets = self.bag_len, self.bag_starts_len
        self.bag_parts.append(rows)
        self.bag_start_parts.append(starts)
        self.bag_len += rows.numel()
        self.bag_starts_len += starts.numel()
        return offsets

    def _add_bias(self, seqs: list[int], row_lo: int, m: int, keys: int) -> int:
        """Append the tile's ``[n_seq, m, keys]`` bias; -1 when every key is visible."""
        batch = self.batch
        # Absolute position of each query row; row r sees keys 0 .. position.
        first = torch.tensor([batch.ctx[s] - batch.q_len[s] + row_lo for s in seqs], dtype=torch.int64)
        positions = first[:, None] + torch.arange(m, dtype=torch.int64)[None, :]
        if int(positions.min()) >= keys - 1:
            return -1
        key_pos = torch.arange(keys, dtype=torch.int64)
        visible = key_pos[None, None, :] <= positions[:, :, None]
        bias = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
        offset = self.bias_len
        self.bias_parts.append(bias.reshape(-1))
        self.bias_len += bias.numel()
        return offset


def build_plan(batch: Batch, *, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               kv_dtype: torch.dtype, scale: float | None, device: torch.device, tile_bytes: int,
               max_bag_rows: int) -> AttentionPlan:
    """Cut a validated batch (:func:`worker.kernels.batch.validate_batch`) into tiles.

    Tiles with at most ``max_bag_rows`` query rows (``m * g``) per pair get
    ``embedding_bag`` indices for their ``probs @ V``.
    """
    if not isinstance(tile_bytes, int) or tile_bytes <= 0:
        raise ValueError(f"tile_bytes must be a positive int, got {tile_bytes!r}")
    builder = _PlanBuilder(batch, num_kv_heads, head_dim, block_size, num_q_heads // num_kv_heads,
                           tile_bytes, max_bag_rows)
    builder.add_decode_tiles()
    for seq, n in enumerate(batch.q_len):
        if n > 1:
            builder.add_extend_tiles(seq)
    return _finish(builder, num_q_heads, kv_dtype, scale, device)


def _finish(builder: _PlanBuilder, num_q_heads: int, kv_dtype: torch.dtype, scale: float | None,
            device: torch.device) -> AttentionPlan:
    def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        return flat.to(device)

    batch = builder.batch
    q_rows = cat(builder.q_parts, torch.int64)
    inverse = torch.empty_like(q_rows)
    inverse[q_rows] = torch.arange(q_rows.numel(), device=device)
    return AttentionPlan(
        num_q_heads=num_q_heads, num_kv_heads=builder.heads, head_dim=builder.head_dim,
        block_size=builder.block_size, kv_dtype=kv_dtype,
        scale=float(scale) if scale is not None else builder.head_dim ** -0.5,
        total_q=batch.q_start[-1], max_block_id=batch.max_block_id, tiles=builder.tiles,
        kv_rows=cat(builder.kv_parts, torch.int64), q_rows=q_rows, inverse_q_rows=inverse,
        bias=cat(builder.bias_parts, torch.float32),
        bag_rows=cat(builder.bag_parts, builder.bag_dtype),
        bag_starts=cat(builder.bag_start_parts, builder.bag_dtype),
        max_kv_elems=builder.max_kv_elems, max_v_elems=builder.max_v_elems,
        max_score_elems=builder.max_score_elems,
    )
