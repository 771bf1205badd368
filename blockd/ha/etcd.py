"""A small synchronous etcd v3 client for the election and the observers.

Built on ``etcd3gw`` (etcd's HTTP/JSON gateway, ``/v3/``): blockd's server
is threaded, not asyncio, so a blocking client owned by one thread fits
(``aetcd`` would need an event loop thread beside gRPC's pool; ``etcd3`` is
broken on current protobuf). ``etcd3gw`` gives the transport (a
``requests`` session, TLS client certificates, HTTP error mapping); this
module adds what the election needs on top and hides the gateway's JSON
(base64 keys, int64 as strings, absent zero fields):

* every call has its own timeout, so a caller with a deadline (a leader
  whose lease validity is running out) never blocks past it;
* one error type, :class:`EtcdUnavailable`, for "no usable answer": the
  caller retries on its next cycle, and a failed call moves to the next
  endpoint of ``--etcd`` (a three-member etcd stays usable when one is down);
* transactions with compares on create revisions, ranges and puts bound to
  leases, returning plain :class:`KeyValue` objects.

Not thread-safe (one ``requests`` session): each thread makes its own.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import etcd3gw
from etcd3gw import exceptions as etcd_errors

DEFAULT_TIMEOUT_S = 2.0


class EtcdUnavailable(Exception):
    """etcd did not answer usefully (down, timed out, or an error); retry later."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    """``succeeded``: which branch ran; ``revision``: the store revision after
    it (the revision of its puts); ``ranges``: per operation of that branch,
    the keys a range found (``None`` for puts and deletes)."""

    succeeded: bool
    revision: int
    ranges: list[list[KeyValue] | None]


def parse_endpoints(text: str | Sequence[str]) -> list[str]:
    """``http://h:p,http://h2:p`` (or a list, or bare ``h:p``) as base URLs; ValueError if malformed."""
    items = text.split(",") if isinstance(text, str) else list(text)
    urls = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        url = item if "://" in item else "http://" + item
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"etcd endpoint must be http(s)://HOST:PORT, got {item!r}")
        urls.append(f"{parts.scheme}://{parts.netloc}")
    if not urls:
        raise ValueError("no etcd endpoint given (expected http://HOST:PORT[,http://HOST:PORT...])")
    return urls


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _kv(doc: dict) -> KeyValue:
    return KeyValue(base64.b64decode(doc["key"]).decode(), base64.b64decode(doc.get("value", "")),
                    int(doc.get("create_revision", 0)), int(doc.get("mod_revision", 0)), int(doc.get("lease", 0)))


def prefix_end(prefix: str) -> str:
    """The end of the range of keys that start with ``prefix`` (etcd's range_end)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


def cmp_created(key: str) -> dict:
    """Compare: ``key`` exists."""
    return {"key": _b64(key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}


def cmp_absent(key: str) -> dict:
    """Compare: ``key`` does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def cmp_create_revision(key: str, revision: int) -> dict:
    """Compare: ``key`` exists and was created at ``revision`` (e.g. the leader key of a term)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def cmp_mod_revision(key: str, revision: int) -> dict:
    """``key`` was last changed at ``revision`` (unchanged since it was read)."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def op_range(key: str, prefix: bool = False) -> dict:
    body = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key))
    return {"request_range": body}


def op_put(key: str, value: bytes, lease: int = 0) -> dict:
    body = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def op_delete(key: str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


class EtcdClient:
    """Blocking calls to one of ``endpoints``; each raises :class:`EtcdUnavailable` on failure."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self._index = 0
        self._clients = [self._client(url) for url in self.endpoints]

    @staticmethod
    def _client(url: str) -> etcd3gw.Etcd3Client:
        parts = urlsplit(url)
        assert parts.hostname and parts.port, url  # parse_endpoints checked both
        return etcd3gw.Etcd3Client(host=parts.hostname, port=parts.port, protocol=parts.scheme, api_path="/v3/")

    def close(self) -> None:
        for client in self._clients:
            client.session.close()

    def post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        """One gateway call to the current endpoint; on failure the next call uses the next endpoint.

        Never retried here: a write that timed out may have been applied,
        and only the caller knows whether repeating it is safe.
        """
        client = self._clients[self._index]
        client.timeout = max(0.01, self.timeout_s if timeout_s is None else timeout_s)
        try:
            return client.post(client.get_url(path), json=body)
        except (etcd_errors.Etcd3Exception, ValueError) as err:  # ValueError: a body that is not JSON
            self._index = (self._index + 1) % len(self._clients)
            detail = getattr(err, "detail_text", None) or str(err) or type(err).__name__
            raise EtcdUnavailable(f"etcd at {client.base_url}: {detail}") from None

    # leases -----------------------------------------------------------------------------------

    def grant(self, ttl_s: int, timeout_s: float | None = None) -> tuple[int, int]:
        """A new lease: ``(lease id, granted TTL in s)``; etcd may raise the TTL to its minimum."""
        reply = self.post("/lease/grant", {"TTL": int(ttl_s), "ID": 0}, timeout_s)
        if reply.get("error"):
            raise EtcdUnavailable(f"lease grant refused: {reply['error']}")
        return int(reply["ID"]), int(reply["TTL"])

    def keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Renew the lease: its TTL from now in s, or 0 when etcd no longer has it."""
        reply = self.post("/lease/keepalive", {"ID": str(lease_id)}, timeout_s)
        return max(0, int(reply.get("result", {}).get("TTL", 0)))

    def time_to_live(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Seconds the lease has left (etcd rounds), or -1 when it is gone."""
        reply = self.post("/kv/lease/timetolive", {"ID": str(lease_id)}, timeout_s)
        return int(reply.get("TTL", -1))

    def revoke(self, lease_id: int, timeout_s: float | None = None) -> None:
        """End the lease now (its keys go at once); a lease already gone is not an error."""
        try:
            self.post("/kv/lease/revoke", {"ID": str(lease_id)}, timeout_s)
        except EtcdUnavailable as err:
            if "lease not found" not in str(err):
                raise

    # keys -------------------------------------------------------------------------------------

    def get(self, key: str, timeout_s: float | None = None) -> KeyValue | None:
        reply = self.post("/kv/range", {"key": _b64(key)}, timeout_s)
        kvs = reply.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, timeout_s: float | None = None) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (in key order) and the store revision of the read."""
        reply = self.post("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}, timeout_s)
        return [_kv(doc) for doc in reply.get("kvs", [])], int(reply["header"]["revision"])

    def put(self, key: str, value: bytes, lease: int = 0, timeout_s: float | None = None) -> int:
        """Write ``key``; the store revision of the write."""
        body = op_put(key, value, lease)["request_put"]
        return int(self.post("/kv/put", body, timeout_s)["header"]["revision"])

    def delete(self, key: str, timeout_s: float | None = None) -> bool:
        reply = self.post("/kv/deleterange", {"key": _b64(key)}, timeout_s)
        return int(reply.get("deleted", 0)) > 0

    def txn(self, compare: list[dict], success: list[dict], failure: Sequence[dict] = (),
            timeout_s: float | None = None) -> TxnResult:
        """If every ``compare`` holds run ``success``, else ``failure``, atomically."""
        reply = self.post("/kv/txn", {"compare": compare, "success": success, "failure": list(failure)},
                          timeout_s)
        ranges: list[list[KeyValue] | None] = []
        for response in reply.get("responses", []):
            found = response.get("response_range")
            ranges.append(None if found is None else [_kv(doc) for doc in found.get("kvs", [])])
        return TxnResult(bool(reply.get("succeeded", False)), int(reply["header"]["revision"]), ranges)
