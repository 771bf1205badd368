"""``BlockService.GetHashSpec`` and the refusal of a worker of another hash spec, over real gRPC.

The reimplementation below reads nothing of :mod:`blockd.core.hashing`: it
takes its constants (the domain tag, the personalizations, the tenants that
fold nothing) out of the returned prose with regular expressions and follows
the prose's recipe with :mod:`hashlib` and :mod:`struct`. It must reproduce
the served test vectors and the block hashes a ``blockd serve`` process
publishes in its KV events for a real Allocate, under extra keys and a
tenant.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import struct

import grpc
import pytest

from blockd.core import Allocate, Commit, ExtraKeys, PoolConfig
from blockd.core.types import WorkerInfo
from blockd.v1 import blockd_pb2 as pb
from blockd.v1 import blockd_pb2_grpc as pb_grpc
from client.aio import AsyncBlockdClient
from client.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from client.messages import register_worker_request
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.grpc_fixtures"]

#: the spec this build serves; a change to any hash must change the id too
PINNED_ID = "blockd.block-hash.v1"
PINNED_VECTORS = [("0c9cdab528df4979271f3f037e4660c8", "da02221b9756b5f9d4e3864a23593794"),
                  ("1099a3a7896846c629c4667a51461fa9", "9e8f1cbc1aaefbb87477b6ac238c83cd")]


class TextSpec:
    """The hash as the prose of a ``GetHashSpecResponse`` describes it."""

    def __init__(self, reply: pb.GetHashSpecResponse) -> None:
        self.domain = re.search(r'the (\d+) ASCII bytes "([^"]+)"', reply.block_hash_encoding)
        assert self.domain and int(self.domain[1]) == len(self.domain[2])
        self.tag = self.domain[2].encode("ascii")
        self.extra_person = re.search(r'personalization "([^"]+)"', reply.extra_keys_encoding)[1].encode()
        self.tenant_person = re.search(r'personalization "([^"]+)"', reply.tenant_encoding)[1].encode()
        self.no_fold = set(re.search(r'If T is "([^"]*)" or "([^"]*)", E = E0', reply.tenant_encoding).groups())
        assert "16 zero bytes" in reply.parent_hash_encoding
        assert "unsigned 32-bit little-endian" in reply.token_ids_encoding
        assert "adapter_id as a signed 64-bit little-endian" in reply.extra_keys_encoding

    @staticmethod
    def _text(raw: str) -> bytes:
        data = raw.encode("utf-8")
        return struct.pack("<I", len(data)) + data

    def extra(self, keys: pb.ExtraKeys, tenant: str) -> bytes:
        body = b"".join(self._text(t) for t in (keys.model_id, keys.model_revision, keys.adapter_name,
                                                keys.cache_salt))
        body += struct.pack("<q", keys.adapter_id) + struct.pack("<I", len(keys.mm_hashes))
        body += b"".join(self._text(m) for m in keys.mm_hashes)
        e0 = hashlib.blake2b(body, digest_size=16, person=self.extra_person).digest()
        if tenant in self.no_fold:
            return e0
        return hashlib.blake2b(self._text(tenant) + e0, digest_size=16, person=self.tenant_person).digest()

    def hashes(self, token_ids, keys: pb.ExtraKeys, tenant: str, block_size: int) -> list[str]:
        extra, parent, out = self.extra(keys, tenant), bytes(16), []
        for i in range(len(token_ids) // block_size):
            block = token_ids[i * block_size:(i + 1) * block_size]
            parent = hashlib.blake2b(self.tag + parent + extra + struct.pack(f"<{block_size}I", *block),
                                     digest_size=16).digest()
            out.append(parent.hex())
        return out


def _stub(target: str) -> tuple[grpc.Channel, pb_grpc.BlockServiceStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.BlockServiceStub(channel)


def test_a_router_reimplementing_the_text_reproduces_the_vectors_and_a_real_daemons_hashes(daemon) -> None:
    proc = daemon()
    channel, stub = _stub(proc.address)
    with channel, BlockdClient(proc.address, timeout_s=5.0) as client:
        bare = stub.GetHashSpec(pb.GetHashSpecRequest(), timeout=5)
        assert bare.spec_id == PINNED_ID and bare.algorithm == "blake2b-128 chained"
        assert (bare.block_size, bare.pool_tenant) == (0, "")
        text = TextSpec(bare)
        assert len(bare.test_vectors) >= 2
        for vector in bare.test_vectors:
            assert text.hashes(list(vector.token_ids), vector.extra_keys, vector.tenant,
                               vector.block_size) == list(vector.block_hashes)
        assert [tuple(v.block_hashes) for v in bare.test_vectors] == PINNED_VECTORS, \
            "a hash changed: bump HASH_SPEC_ID in blockd/core/hashing.py, then these pins"

        # a real Allocate in a pool of a tenant, under every kind of extra key
        client.create_pool(PoolConfig("chat", num_blocks=32, block_size=4, tenant="acme"))
        client.create_pool(PoolConfig("plain", num_blocks=32, block_size=8))
        keys = ExtraKeys("llama", "r\u00e9v", "lora-a", -3, "salt", ("img",))
        prompt = [5, 0, 2**32 - 1, 7, 11, 13, 17, 19, 23, 29, 31]
        client.step("chat", [Allocate("s", prompt, keys), Commit("s", len(prompt))])
        client.step("plain", [Allocate("s", prompt), Commit("s", len(prompt))])
        chat_keys = pb.ExtraKeys(model_id="llama", model_revision="r\u00e9v", adapter_name="lora-a", adapter_id=-3,
                                 cache_salt="salt", mm_hashes=["img"])
        for pool, wire_keys, full, served in (("chat", chat_keys, 2, (4, "acme")),
                                              ("plain", pb.ExtraKeys(), 1, (8, "default"))):
            spec = stub.GetHashSpec(pb.GetHashSpecRequest(pool=pool), timeout=5)
            assert (spec.block_size, spec.pool_tenant) == served and spec.spec_id == PINNED_ID
            ours = text.hashes(prompt, wire_keys, spec.pool_tenant, spec.block_size)
            stored = _stored(client, pool, full)
            assert len(ours) == full and [e.block_hash.hex() for e in stored] == ours
            assert [e.parent_hash.hex() for e in stored] == ["", *ours[:-1]]
        # the index answers LookupPrefix for exactly the blocks those hashes name
        assert client.lookup_prefix(prompt, keys, ["chat"]) == {"chat": 8}
        assert client.lookup_prefix(prompt, keys, ["plain"]) == {"plain": 0}  # other extra keys: other hashes


def _stored(client: BlockdClient, pool: str, count: int) -> list:
    """The first ``count`` BlockStored events of ``pool``."""
    events = []
    stream = client.events(pool, 0, timeout_s=5.0)
    try:
        for event in stream:
            if event.kind == "BlockStored":
                events.append(event)
            if len(events) == count:
                return events
    finally:
        stream.close()
    return events


def test_an_unknown_pool_is_not_found_and_changes_nothing(blockd_server, client) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    before = blockd_server.engine.capture()
    with pytest.raises(NotFoundError) as raised:
        client.get_hash_spec("nope")
    assert "no pool named 'nope'" in raised.value.message and raised.value.reason == "NOT_FOUND"
    with pytest.raises(InvalidArgumentError) as bad:
        client.get_hash_spec("x" * 300)
    assert bad.value.field_violations[0][0] == "pool"
    assert blockd_server.engine.capture() == before
    assert client.get_hash_spec("p").block_size == 4 and client.get_hash_spec().block_size == 0


def _worker(worker_id: str = "w0") -> WorkerInfo:
    return WorkerInfo(worker_id, "p", "127.0.0.1:9", 0, 1, 0, 1, incarnation=f"inc-{worker_id}")


def test_a_worker_of_another_hash_spec_is_refused_and_nothing_registers(blockd_server, client) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    client.step("p", [Allocate("s", [1, 2, 3, 4, 5]), Commit("s", 5)])
    before = blockd_server.engine.capture()
    with pytest.raises(FailedPreconditionError) as raised:
        client.register_worker(_worker(), hash_spec="blockd.block-hash.v0")
    err = raised.value
    assert err.reason == "HASH_SPEC_MISMATCH"
    assert err.metadata["hash_spec"] == "blockd.block-hash.v0" and err.metadata["blockd_hash_spec"] == PINNED_ID
    assert "'blockd.block-hash.v0'" in err.message and repr(PINNED_ID) in err.message
    assert "worker 'w0'" in err.message and "upgrade the worker" in err.message
    assert client.list_workers() == [] and blockd_server.engine.capture() == before
    # a worker of no pool is refused for its spec all the same, before the pool is looked up
    with pytest.raises(FailedPreconditionError):
        client.register_worker(WorkerInfo("w9", "nope", "127.0.0.1:9", 0, 1, 0, 1, incarnation="i"),
                               hash_spec="other")


def test_a_worker_of_this_spec_or_of_none_registers(blockd_server, client) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    assert register_worker_request(_worker(), None).hash_spec == PINNED_ID  # what blockd-worker sends
    client.register_worker(_worker("w0"))
    client.register_worker(_worker("w1"), hash_spec="")  # a worker older than the field
    assert sorted(w.info.worker_id for w in client.list_workers("p")) == ["w0", "w1"]


def test_the_async_client_reads_and_checks_the_spec(blockd_server, client) -> None:
    client.create_pool(PoolConfig("p", num_blocks=8, block_size=16, tenant="acme"))

    async def main():
        async with AsyncBlockdClient(blockd_server.address, timeout_s=5.0) as aio:
            spec = await aio.get_hash_spec("p")
            checked = await aio.check_hash_spec()
            with pytest.raises(FailedPreconditionError):
                await aio.register_worker(_worker(), hash_spec="other")
            return spec, checked

    spec, checked = asyncio.run(main())
    assert (spec.block_size, spec.pool_tenant, checked.spec_id) == (16, "acme", PINNED_ID)
    assert spec == client.get_hash_spec("p")
