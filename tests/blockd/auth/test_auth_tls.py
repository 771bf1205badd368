"""TLS, mutual TLS, tokens and roles over real gRPC, with certificates made here.

An in-process blockd with :func:`blockd.auth.server_security` (as ``blockd
serve`` builds it) and the SDK on the other end. A refused handshake is
UNAVAILABLE to the client (there is no connection to carry a status); a
refused call on a good connection is UNAUTHENTICATED or PERMISSION_DENIED
and changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import grpc
import pytest
from cryptography import x509

from blockd.auth import TlsConfig, tokens
from blockd.auth.audit import AUDIT_LOGGER
from blockd.auth.certs import make_ca, make_server_cert
from blockd.core import Allocate, PoolConfig
from client.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.auth_fixtures"]

TIMEOUT_S = 10.0
TENANT = "acme"  # the client certificates' tenant (tests.support.auth_fixtures)


def connect(server, tls=None, token=None, **kwargs) -> BlockdClient:
    return BlockdClient(server.address, timeout_s=TIMEOUT_S, max_attempts=1, tls=tls, token=token, **kwargs)


@pytest.fixture
def mtls(pki, secure_server):
    return secure_server(pki.server_tls(mutual=True))


def test_mutual_tls_admits_a_client_certificate_of_the_ca(pki, mtls) -> None:
    with connect(mtls, pki.tls("admin")) as admin:
        admin.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    with connect(mtls, pki.tls("scheduler")) as scheduler:
        assert scheduler.step("p", [Allocate("a", [1, 2, 3])]).results[0].slot_mapping == (0, 1, 2)
        assert [s.name for s in scheduler.list_pools()] == ["p"]


@pytest.mark.parametrize("client", [None, "rogue", "expired"],
                         ids=["no-client-cert", "untrusted-ca", "expired-cert"])
def test_mutual_tls_refuses_the_handshake(pki, mtls, client) -> None:
    with connect(mtls, pki.tls(client)) as c, pytest.raises(UnavailableError):
        c.list_pools()
    assert mtls.engine.list_pools() == []


def test_a_client_that_does_not_trust_the_server_refuses_it(pki, secure_server, tmp_path) -> None:
    server = secure_server(pki.server_tls(mutual=False))
    other = tmp_path / "other-ca.pem"
    other.write_bytes(make_ca("another CA").cert_pem)
    with connect(server, TlsConfig(ca=str(other))) as c, pytest.raises(UnavailableError):
        c.list_pools()


@pytest.mark.parametrize(("client", "message"), [
    ("plain-cn", "CN='legacy-client'"), ("bad-uri", "names no valid blockd identity")])
def test_a_trusted_certificate_that_names_no_identity_is_unauthenticated(pki, mtls, client, message) -> None:
    with connect(mtls, pki.tls(client)) as c, pytest.raises(UnauthenticatedError, match=message):
        c.list_pools()


def test_a_certificate_cn_maps_through_the_identities_file(pki, secure_server, tmp_path) -> None:
    path = tmp_path / "ids.json"
    path.write_text(json.dumps({"version": 1, "subjects": [
        {"cn": "legacy-client", "name": "legacy", "tenant": TENANT, "roles": ["reader"]}]}))
    server = secure_server(pki.server_tls(mutual=True), str(path))
    with connect(server, pki.tls("plain-cn")) as c:
        assert c.list_pools() == []
        with pytest.raises(PermissionDeniedError, match="legacy@acme"):
            c.create_pool(PoolConfig("p", num_blocks=8, block_size=4))


def _state(engine) -> list:
    return [(s.name, s.num_seqs, s.version, s.num_free_blocks) for s in engine.list_pools()]


def test_a_reader_cannot_mutate_and_nothing_changes(pki, mtls) -> None:
    with connect(mtls, pki.tls("admin")) as admin:
        admin.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
        admin.step("p", [Allocate("a", [1, 2, 3, 4, 5])])
    before = _state(mtls.engine)
    with connect(mtls, pki.tls("reader")) as reader:
        assert reader.get_tables("p")[1] == mtls.engine.get_tables("p", ())[1]
        refusals = [lambda: reader.create_pool(PoolConfig("q", num_blocks=8, block_size=4)),
                    lambda: reader.delete_pool("p"), lambda: reader.reset_prefix_cache("p"),
                    lambda: reader.step("p", [Allocate("b", [1])])]
        for refused in refusals:
            with pytest.raises(PermissionDeniedError) as err:
                refused()
            assert "reader-0@acme (reader) may not call" in str(err.value)
    assert _state(mtls.engine) == before


def test_a_worker_may_not_step_and_a_scheduler_may_not_delete(pki, mtls) -> None:
    with connect(mtls, pki.tls("admin")) as admin:
        admin.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    with connect(mtls, pki.tls("worker")) as worker, pytest.raises(PermissionDeniedError, match="'step'"):
        worker.step("p", [Allocate("a", [1])])
    with connect(mtls, pki.tls("scheduler")) as scheduler, pytest.raises(PermissionDeniedError):
        scheduler.delete_pool("p")
    assert _state(mtls.engine) == [("p", 0, 0, 8)]


# --- tokens ---------------------------------------------------------------------------------
@pytest.fixture
def token_server(pki, secure_server, tmp_path):
    path = str(tmp_path / "ids.json")
    server = secure_server(pki.server_tls(mutual=False), path_with_tokens(path))
    return server, path


def path_with_tokens(path: str) -> str:
    tokens.add_token(path, "seed", TENANT, ["reader"])
    return path


def test_tokens_over_server_tls(pki, token_server) -> None:
    server, path = token_server
    admin_token = tokens.add_token(path, "ops", TENANT, ["admin"])
    reader_token = tokens.add_token(path, "dash", TENANT, ["reader"])
    server.security.reload()
    with connect(server, pki.tls(), admin_token) as admin:
        admin.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    with connect(server, pki.tls(), reader_token) as reader:
        assert [s.name for s in reader.list_pools()] == ["p"]
        with pytest.raises(PermissionDeniedError, match="dash@acme"):
            reader.delete_pool("p")
    assert [s.name for s in server.engine.list_pools()] == ["p"]


@pytest.mark.parametrize("token", [None, "bkd_not-a-real-token", "x" * 600])
def test_missing_or_bad_tokens_are_unauthenticated_and_never_echoed(pki, token_server, token) -> None:
    server, _ = token_server
    with connect(server, pki.tls(), token) as c, pytest.raises(UnauthenticatedError) as err:
        c.list_pools()
    if token is not None:
        assert token not in str(err.value) and "bkd_" not in str(err.value)


def test_a_malformed_authorization_header_is_unauthenticated(pki, token_server) -> None:
    server, _ = token_server
    creds = grpc.ssl_channel_credentials(read(pki.ca))
    with grpc.secure_channel(server.address, creds) as channel:
        call = channel.unary_unary("/blockd.v1.PoolService/ListPools", request_serializer=lambda m: b"",
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(b"", metadata=[("authorization", "Basic c2VjcmV0")], timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "c2VjcmV0" not in err.value.details()


def test_a_token_without_tls_is_only_sent_to_loopback(pki) -> None:
    with pytest.raises(ValueError, match="plain text"):
        BlockdClient("10.0.0.7:50051", token="bkd_x")


# --- audit ------------------------------------------------------------------------------------
def test_audit_lines_for_admin_actions_and_refusals_carry_no_secret(pki, token_server, caplog) -> None:
    server, path = token_server
    admin_token = tokens.add_token(path, "ops", TENANT, ["admin"])
    reader_token = tokens.add_token(path, "dash", TENANT, ["reader"])
    server.security.reload()
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    with connect(server, pki.tls(), admin_token) as admin:
        admin.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
        admin.list_pools()  # a read: not audited
    with connect(server, pki.tls(), reader_token) as reader, pytest.raises(PermissionDeniedError):
        reader.delete_pool("p")
    with connect(server, pki.tls(), "bkd_wrong") as stranger, pytest.raises(UnauthenticatedError):
        stranger.list_pools()
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == AUDIT_LOGGER]
    assert [(x["event"], x["method"].rsplit("/", 1)[1], x["outcome"], x["identity"]) for x in lines] == [
        ("admin", "CreatePool", "OK", "ops"),
        ("denied", "DeletePool", "PERMISSION_DENIED", "dash"),
        ("denied", "ListPools", "UNAUTHENTICATED", None)]
    assert lines[0]["tenant"] == TENANT and lines[0]["roles"] == ["admin"] and lines[0]["credential"] == "token"
    assert all(x["peer"].startswith("ipv4:127.0.0.1:") and x["time"].endswith("Z") for x in lines)
    text = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (admin_token, reader_token, "bkd_wrong", tokens.token_digest(admin_token)):
        assert secret not in text


# --- rotation ----------------------------------------------------------------------------------
def replace(dst, data: bytes) -> None:
    """Write ``dst`` by rename, as cert-manager and Kubernetes Secret volumes do."""
    tmp = f"{dst}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _served_certificate(address: str) -> x509.Certificate:
    import socket
    import ssl

    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock, \
            context.wrap_socket(sock) as tls_sock:
        return x509.load_der_x509_certificate(tls_sock.getpeercert(binary_form=True))


def test_server_certificate_rotation_without_restart(pki, secure_server, tmp_path) -> None:
    """New connections see the new certificate (and new CA), the server never restarts."""
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.pem", "server-key.pem"):
        shutil.copy(os.path.join(pki.dir, name), live / name)
    server = secure_server(TlsConfig(str(live / "server.pem"), str(live / "server-key.pem")))
    first = _served_certificate(server.address)
    with connect(server, pki.tls()) as c:
        assert c.list_pools() == []
    new_ca = make_ca("rotated CA")
    rotated = make_server_cert(new_ca, name="blockd-rotated")
    replace(live / "server-key.pem", rotated.key_pem)  # key first: in between, the pair does not match
    replace(live / "server.pem", rotated.cert_pem)
    (tmp_path / "new-ca.pem").write_bytes(new_ca.cert_pem)
    second = _served_certificate(server.address)
    assert second.serial_number != first.serial_number and "blockd-rotated" in second.subject.rfc4514_string()
    with connect(server, TlsConfig(ca=str(tmp_path / "new-ca.pem"))) as c:
        assert c.list_pools() == []
    with connect(server, pki.tls()) as c, pytest.raises(UnavailableError):  # the old CA no longer verifies it
        c.list_pools()
    assert server.security.certificates.loads == 2


def test_a_half_written_rotation_keeps_the_previous_certificate(pki, secure_server, tmp_path, caplog) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.pem", "server-key.pem"):
        shutil.copy(os.path.join(pki.dir, name), live / name)
    server = secure_server(TlsConfig(str(live / "server.pem"), str(live / "server-key.pem")))
    caplog.set_level(logging.ERROR, logger="blockd.auth")
    replace(live / "server.pem", make_server_cert(make_ca()).cert_pem)  # the key is still the old one
    with connect(server, pki.tls()) as c:
        assert c.list_pools() == []
    assert "does not belong to the certificate" in caplog.text
    assert server.security.certificates.loads == 1


def test_a_rotating_client_channel_picks_up_a_new_client_certificate(pki, mtls, tmp_path) -> None:
    live = tmp_path / "client"
    live.mkdir()
    for src, dst in (("reader.pem", "me.pem"), ("reader-key.pem", "me-key.pem")):
        shutil.copy(os.path.join(pki.dir, src), live / dst)
    tls = TlsConfig(str(live / "me.pem"), str(live / "me-key.pem"), pki.ca)
    with connect(mtls, tls) as c:
        with pytest.raises(PermissionDeniedError):
            c.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
        replace(live / "me-key.pem", read(pki.key("admin")))
        replace(live / "me.pem", read(pki.path("admin")))
        c._channel.check()  # rather than wait for the next periodic look
        c.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
        assert c._channel.generation == 1


def test_the_asyncio_client_speaks_mutual_tls_and_tokens(pki, token_server, mtls) -> None:
    import asyncio

    from client.aio import AsyncBlockdClient

    server, path = token_server
    token = tokens.add_token(path, "ops", TENANT, ["admin"])
    server.security.reload()

    async def scenario() -> list:
        async with AsyncBlockdClient(mtls.address, tls=pki.tls("admin"), max_attempts=1) as by_cert:
            await by_cert.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
        async with AsyncBlockdClient(server.address, tls=pki.tls(), token=token, max_attempts=1) as by_token:
            await by_token.create_pool(PoolConfig("q", num_blocks=8, block_size=4))
        async with AsyncBlockdClient(server.address, tls=pki.tls(), token="bkd_no", max_attempts=1) as bad:
            with pytest.raises(UnauthenticatedError):
                await bad.list_pools()
        return [[s.name for s in mtls.engine.list_pools()], [s.name for s in server.engine.list_pools()]]

    assert asyncio.run(scenario()) == [["p"], ["q"]]


def test_a_tenant_refusal_in_the_handler_is_permission_denied_and_audited(pki, caplog) -> None:
    """The hook the engine uses: the interceptor binds the identity, the handler calls
    require_tenant, the refusal leaves through blockd's one error mapping and is audited."""
    from concurrent import futures

    from blockd.auth import current_identity, require_tenant, server_security
    from blockd.rpc.errors import unary
    from blockd.v1 import blockd_pb2 as pb

    class Pools:
        @unary
        def GetPool(self, request, context):
            require_tenant("globex", f"pool {request.pool!r}")
            return pb.GetPoolResponse(stats=pb.PoolStats(name=current_identity().name))

    security = server_security("127.0.0.1:0", pki.server_tls(mutual=True))
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=security.interceptors)
    handler = grpc.unary_unary_rpc_method_handler(Pools().GetPool, request_deserializer=pb.GetPoolRequest.FromString,
                                                  response_serializer=pb.GetPoolResponse.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("blockd.v1.PoolService",
                                                                          {"GetPool": handler})])
    port = server.add_secure_port("127.0.0.1:0", security.credentials)
    server.start()
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    try:
        address = f"127.0.0.1:{port}"
        with BlockdClient(address, max_attempts=1, tls=pki.tls("other-tenant")) as c:
            assert c.get_pool("g").name == "sched-g"
        with BlockdClient(address, max_attempts=1, tls=pki.tls("scheduler")) as c, \
                pytest.raises(PermissionDeniedError, match="does not belong to tenant 'acme'"):
            c.get_pool("g")
    finally:
        server.stop(0)
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == AUDIT_LOGGER]
    assert (line["event"], line["outcome"], line["identity"], line["tenant"]) == \
        ("denied", "PERMISSION_DENIED", "scheduler-0", TENANT)
    assert "does not belong to tenant 'acme'" in line["reason"]
