"""What security costs a scheduler's step: TLS, mutual TLS, tokens, the auth interceptor.

Prints one JSON object per line.

``interceptor``: the auth layer's own Python cost per call, in process (no
gRPC): authenticate (a bearer token: SHA-256 and a lookup; a client
certificate: gRPC's auth context, cached identity), check the role, bind
the identity. ``token_us`` / ``cert_us``: median microseconds per call.

``step_security``: one ``blockd serve`` per variant (state in memory), each
with a pool of 256 running sequences, and the same 256-sequence decode step
(one ``decode_append``) through the sync SDK, as in ``bench/rpc.py``.
Variants: ``plain`` (loopback, no authentication: the baseline), ``token``
(plain text on loopback, ``--tokens-file``, bearer token), ``tls`` (server
TLS only), ``mtls`` (mutual TLS, identity from the client certificate),
``mtls_token`` (mutual TLS and a token). The variants run in interleaved
rounds so machine drift hits them alike. Fields: ``p50_ms``, ``p99_ms``,
``p50_ratio`` / ``p99_ratio`` against ``plain`` in the same run.

Run: ``python bench/auth.py [--part interceptor|step_security] [--seconds 6] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import namedtuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.daemon import BLOCK_SIZE, MAX_STEPS, NUM_BLOCKS, NUM_SEQS, percentile, start_daemon, stop_daemon
from blockd.auth import TlsConfig
from blockd.auth.certs import make_ca, make_client_cert, make_server_cert, write_pair
from blockd.auth.identity import bind_identity
from blockd.auth.interceptor import Authenticator
from blockd.auth.policy import allows, required_permission
from blockd.auth.tokens import IdentityRegistry, add_token
from blockd.core import Allocate, PoolConfig
from client.sdk import BlockdClient

Metadatum = namedtuple("Metadatum", "key value")
STEP = "/blockd.v1.BlockService/Step"


def interceptor(directory: str, reps: int = 20000):
    """The per-call cost of the auth layer, without gRPC around it."""
    path = os.path.join(directory, "bench-ids.json")
    token = add_token(path, "bench", "acme", ["scheduler"])
    authenticator = Authenticator(IdentityRegistry(path))
    with_token = (Metadatum("user-agent", "grpc-python"), Metadatum("authorization", f"Bearer {token}"))
    without = (Metadatum("user-agent", "grpc-python"),)
    cert_context = {"transport_security_type": [b"ssl"], "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----"],
                    "x509_common_name": [b"s-0"], "peer_uri": [b"spiffe://blockd/tenant/acme/role/scheduler/id/s-0"]}

    def one(metadata, context) -> None:
        identity = authenticator.authenticate(metadata, lambda: dict(context))
        assert allows(identity.roles, required_permission(STEP))
        bind_identity(identity)

    out = {"bench": "interceptor"}
    for name, metadata, context in (("token_us", with_token, {}), ("cert_us", without, cert_context)):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            one(metadata, context)
            times.append(time.perf_counter() - start)
        out[name] = round(statistics.median(times) * 1e6, 2)
    bind_identity(None)
    return [out]


def _pki(directory: str) -> dict[str, str]:
    ca = make_ca()
    paths = {"ca": write_pair(directory, "ca", ca)[0]}
    paths["server"], paths["server_key"] = write_pair(directory, "server", make_server_cert(ca))
    paths["client"], paths["client_key"] = write_pair(directory, "sched",
                                                     make_client_cert(ca, "s-0", "acme", ("admin",)))
    return paths


def security_variants(directory: str) -> dict[str, tuple[list[str], dict]]:
    """name -> (blockd serve flags, BlockdClient keyword arguments)."""
    pki = _pki(directory)
    tokens_file = os.path.join(directory, "ids.json")
    token = add_token(tokens_file, "bench-admin", "acme", ["admin"])
    server_tls = ["--tls-cert", pki["server"], "--tls-key", pki["server_key"]]
    mutual = [*server_tls, "--tls-client-ca", pki["ca"]]
    client_cert = TlsConfig(pki["client"], pki["client_key"], pki["ca"])
    return {
        "plain": ([], {}),
        "token": (["--tokens-file", tokens_file], {"token": token}),
        "tls": (server_tls, {"tls": TlsConfig(ca=pki["ca"])}),
        "mtls": (mutual, {"tls": client_cert}),
        "mtls_token": ([*mutual, "--tokens-file", tokens_file], {"tls": client_cert, "token": token}),
    }


def _steps(client: BlockdClient, pool: str, seconds: float, budget: list[int]) -> list[float]:
    ids = [f"{pool}-{i}" for i in range(NUM_SEQS)]
    tokens = [7] * NUM_SEQS
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and budget[0] > 0:
        start = time.perf_counter()
        client.decode_append(pool, ids, tokens)
        times.append(time.perf_counter() - start)
        budget[0] -= 1
    return times


def step_security(directory: str, seconds: float, rounds: int):
    variants = security_variants(directory)
    running, clients, budgets = {}, {}, {}
    try:
        for name, (flags, kwargs) in variants.items():
            running[name], address = start_daemon(*flags)
            clients[name] = client = BlockdClient(address, **kwargs)
            client.create_pool(PoolConfig("bench", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
            client.step("bench", [Allocate(f"bench-{i}", list(range(BLOCK_SIZE))) for i in range(NUM_SEQS)])
            budgets[name] = [MAX_STEPS - 1]
            _steps(client, "bench", 0.3, budgets[name])  # warm up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name in variants:
                times[name] += _steps(clients[name], "bench", seconds / rounds, budgets[name])
    finally:
        for client in clients.values():
            client.close()
        for proc in running.values():
            stop_daemon(proc)
    base = sorted(times["plain"])
    base_p50, base_p99 = percentile(base, 0.5), percentile(base, 0.99)
    for name, values in times.items():
        values.sort()
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        yield {"bench": "step_security", "variant": name, "steps": len(values), "p50_ms": round(p50 * 1e3, 3),
               "p99_ms": round(p99 * 1e3, 3), "p50_ratio": round(p50 / base_p50, 3),
               "p99_ratio": round(p99 / base_p99, 3), "cpus": os.cpu_count()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", action="append", choices=("interceptor", "step_security"))
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per variant")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args()
    parts = args.part or ["interceptor", "step_security"]
    with tempfile.TemporaryDirectory(prefix="blockd-bench-auth-") as directory:
        if "interceptor" in parts:
            for row in interceptor(directory):
                print(json.dumps(row), flush=True)
        if "step_security" in parts:
            for row in step_security(directory, args.seconds, args.rounds):
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
