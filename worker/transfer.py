"""Blocks shared across pools, worker to worker: serving blocks of this shard to
another pool's worker (``ReadBlocks``) and fetching a transfer plan's blocks
into this shard (``FetchBlocks``).

blockd plans a transfer (:class:`~blockd.core.types.TransferPlan`) and never
sees the bytes; the two workers vouch for them:

* the source serves block ``b`` as of the planned version ``v`` only when its
  mirror has applied ``v``, no version after ``v`` gave ``b`` other contents
  (:meth:`worker.tables.TableMirror.changed_since`) and its written-slot record
  says every slot of ``b`` is written in its current incarnation; the caller
  names the source's pool and worker incarnations, so a worker that restarted
  or a pool that was re-created since is refused, never read. The blocks are
  copied out under the runtime's lock, then streamed in chunks of at most
  :data:`CHUNK_BYTES`, each with its CRC-32;
* the destination checks each chunk's CRC-32 and each block's size, and writes
  the blocks only once all arrived (a failed fetch writes nothing), at exactly
  the version whose tables hold them, marking them written in every layer.

Shard to shard: the reader names the layer and KV-head range and the block
geometry it expects, and the source refuses any other, so the bytes land in
the same layout. Imports torch, grpc, the core's errors, the generated
stubs and the SDK's channel (to dial the source).
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import torch

from blockd.core.errors import InvalidArgument, WrongState
from blockd.v1 import worker_pb2_grpc
from client.channel import dial
from worker.tables import StaleVersion

#: most bytes of one ReadBlocks message (well under gRPC's default 4 MiB)
CHUNK_BYTES = 1 << 20
TIERS = ("device", "host")


def _shard_of(runtime) -> tuple[int, int, int, int, int, int, str]:
    shard, config = runtime.shard, runtime.config
    return (shard.layer_start, shard.layer_end, shard.kv_head_start, shard.kv_head_end, config.block_size,
            config.head_dim, config.dtype)


def _settle(runtime, version: int, pool_incarnation: str) -> None:
    """Bring the mirror to at least ``version`` of ``pool_incarnation`` (under the lock)."""
    with contextlib.suppress(StaleVersion):  # already past it: which blocks changed since is known
        runtime._advance(version, pool_incarnation)


def read_blocks(runtime, version: int, pool_incarnation: str, tiers: Sequence[str], blocks: Sequence[int],
                expected: tuple) -> list[torch.Tensor]:
    """Copies of ``blocks`` (each ``[layers, 2, kv_heads, block_size, head_dim]``)
    as of ``version``; ``expected``: the reader's shard and geometry, as :func:`_shard_of`."""
    if expected != _shard_of(runtime):
        raise WrongState(f"the reader expects shard and geometry {expected} (layers, KV heads, block size, "
                         f"head size, dtype), this worker holds {_shard_of(runtime)}: pair ranks of equal shards")
    if len(tiers) != len(blocks) or not blocks:
        raise InvalidArgument(f"name one tier per block and at least one block ({len(tiers)} tiers, "
                              f"{len(blocks)} blocks)")
    host = runtime.host
    with runtime._lock:
        _settle(runtime, version, pool_incarnation)
        mirror, written = runtime.mirror, runtime.written
        rows = []
        for i, (tier, block) in enumerate(zip(tiers, blocks, strict=True)):
            if tier not in TIERS:
                raise InvalidArgument(f"tiers[{i}] is {tier!r}, not one of {TIERS}")
            in_host = tier == "host"
            size = (host.num_blocks if host is not None else 0) if in_host else runtime.config.num_blocks
            if not 0 <= block < size:
                raise InvalidArgument(f"block {block} is outside this worker's {size} {tier} blocks")
            changed = mirror.changed_since(in_host, block, version)
            if changed:
                raise WrongState(f"{tier} block {block} got other contents at version {changed}, after the "
                                 f"planned {version}: its KV is gone from this pool; compute the tokens")
            rows.append(block + written.num_blocks if in_host else block)
        lead = written.lead[:, torch.tensor(rows, dtype=torch.int64)]
        if bool((lead < runtime.config.block_size).any()):
            raise WrongState("a planned block is not fully written in this worker's incarnation; compute the "
                             "tokens")
        out = []
        for tier, block in zip(tiers, blocks, strict=True):
            kv = host.host_kv if tier == "host" else runtime.kv
            view = kv[:, :, block]  # copied (once) before the lock is let go
            out.append(view.clone(memory_format=torch.contiguous_format) if view.device.type == "cpu"
                       else view.contiguous().cpu())
        return out


def chunks(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int, int, bytes, int, int]]:
    """``(index, offset, data, crc32, block bytes)`` of each tensor's bytes, in order."""
    for index, tensor in enumerate(tensors):
        raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()  # any dtype, bfloat16 too; no copy
        for offset in range(0, len(raw), CHUNK_BYTES):
            data = raw[offset : offset + CHUNK_BYTES].tobytes()  # the one copy: the message's bytes
            yield index, offset, data, zlib.crc32(data), len(raw)


def assemble(runtime, responses, num_blocks: int) -> torch.Tensor:
    """The blocks of a ReadBlocks stream as uint8 ``[num_blocks, block bytes]``,
    each chunk's CRC-32 and place checked (each chunk copied once, into place)."""
    shape = (runtime.geometry.num_layers, 2, runtime.geometry.num_kv_heads, runtime.config.block_size,
             runtime.config.head_dim)
    want = int(torch.Size(shape).numel()) * runtime.kv.element_size()
    out = torch.empty(num_blocks, want, dtype=torch.uint8)
    rows = out.numpy()  # the same memory: numpy reads the messages' bytes without a tensor over them
    filled = [0] * num_blocks
    for r in responses:
        if not 0 <= r.index < num_blocks or r.offset != filled[r.index] or r.block_bytes != want \
                or r.offset + len(r.data) > want:
            raise WrongState(f"the source sent chunk {r.index}@{r.offset} of {r.block_bytes} bytes; expected "
                             f"blocks of {want} bytes in order: the pools' shards differ")
        if zlib.crc32(r.data) != r.crc32:
            raise WrongState(f"block {r.index}'s chunk at byte {r.offset} failed its CRC-32 check; compute "
                             "the tokens")
        if r.data:
            rows[r.index, r.offset : r.offset + len(r.data)] = np.frombuffer(r.data, dtype=np.uint8)
        filled[r.index] += len(r.data)
    short = [i for i, n in enumerate(filled) if n != want]
    if short:
        raise WrongState(f"the source's stream ended before block {short[0]} was whole; compute the tokens")
    return out


class Peers:
    """Channels to other pools' workers (one per address, kept), with this
    worker's client credentials (those it uses towards blockd)."""

    def __init__(self, runtime, tls=None, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.runtime, self.tls, self.token, self.timeout_s = runtime, tls, token, timeout_s
        self._stubs: dict[str, worker_pb2_grpc.KVShardServiceStub] = {}
        self._lock = threading.Lock()

    def read(self, address: str, request, num_blocks: int) -> torch.Tensor:
        """Blocks read from ``address`` (``ReadBlocks``), checked; the source's refusal as WrongState."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = dial(address, tls=self.tls, token=self.token, max_message_bytes=CHUNK_BYTES + (64 << 10))
                stub = self._stubs[address] = worker_pb2_grpc.KVShardServiceStub(channel)
        try:
            return assemble(self.runtime, stub.ReadBlocks(request, timeout=self.timeout_s), num_blocks)
        except grpc.RpcError as err:
            raise WrongState(f"the source worker {address} of pool {request.pool!r} refused the read "
                             f"({err.code().name}: {err.details()}); compute the tokens") from None


def write_blocks(runtime, version: int, pool_incarnation: str, dst_blocks: Sequence[int],
                 blobs: torch.Tensor) -> None:
    """Write fetched blocks (:func:`assemble`'s) into ``dst_blocks`` at exactly
    ``version``, marked written in every layer."""
    num = runtime.config.num_blocks
    if not dst_blocks or any(not 0 <= b < num for b in dst_blocks) or len(set(dst_blocks)) != len(dst_blocks):
        raise InvalidArgument(f"destination blocks must be distinct blocks of this worker's {num}")
    kv = runtime.kv
    shape = (kv.shape[0], 2, kv.shape[3], kv.shape[4], kv.shape[5])
    if blobs.shape[0] != len(dst_blocks):
        raise InvalidArgument(f"{blobs.shape[0]} blocks fetched for {len(dst_blocks)} destination blocks")
    # [n, layers, 2, heads, block, dim] seen as the pool's [layers, 2, n, heads, block, dim]: no copy
    data = blobs.view(kv.dtype).view(len(dst_blocks), *shape).permute(1, 2, 0, 3, 4, 5)
    ids = torch.tensor(list(dst_blocks), dtype=torch.int64)
    with runtime._lock:
        runtime._advance(version, pool_incarnation)  # the version whose tables hold them, exactly
        kv.index_copy_(2, ids.to(kv.device), data.to(kv.device))
        b = runtime.config.block_size
        blocks = ids.repeat_interleave(b)
        runtime.written.mark_split(slice(None), blocks, torch.arange(b, dtype=torch.int64).repeat(len(ids)), ids)


__all__ = ["CHUNK_BYTES", "Peers", "assemble", "chunks", "read_blocks", "write_blocks"]
