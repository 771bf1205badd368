"""blockd.auth piece by piece: the policy table, identities, tokens, audit lines,
flags, imports; and the table checked against every RPC over real gRPC."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from blockd.auth import AccessDenied, Identity, acting_as, current_identity, require_tenant, visible_to_caller
from blockd.auth.audit import audit_line
from blockd.auth.config import (
    InsecureListen,
    TlsConfig,
    TlsError,
    check_listen,
    is_loopback_target,
    server_tls,
)
from blockd.auth.identity import BadIdentity, parse_spiffe_uri, spiffe_uri
from blockd.auth.interceptor import Unauthenticated, bearer_token
from blockd.auth.policy import (
    AUTHENTICATED,
    METHOD_PERMISSIONS,
    OPEN,
    PERMISSIONS,
    ROLE_PERMISSIONS,
    UnknownMethod,
    required_permission,
)
from blockd.auth.tokens import (
    IdentitiesFileError,
    IdentityRegistry,
    add_token,
    parse_identities,
    remove_token,
)
from blockd.rpc.errors import status_for
from blockd.v1 import blockd_pb2, groups_pb2, replication_pb2, worker_pb2
from tests.conftest import ROOT

SERVED = [*blockd_pb2.DESCRIPTOR.services_by_name.values(), *worker_pb2.DESCRIPTOR.services_by_name.values(),
          health_pb2.DESCRIPTOR.services_by_name["Health"],
          reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
pytest_plugins = ["tests.support.auth_fixtures"]

ALL_METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVED for m in s.methods]


# --- the policy -----------------------------------------------------------------------------------
def test_every_rpc_of_every_service_has_a_permission_and_no_entry_is_stale() -> None:
    # a replica also serves the replication service (blockd serve --etcd), a cluster's group the group
    # service (blockd serve --cluster)
    replication = [f"/{s.full_name}/{m.name}" for module in (replication_pb2, groups_pb2)
                   for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods]
    paths = {path for path, _ in ALL_METHODS} | set(replication)
    missing = sorted(paths - set(METHOD_PERMISSIONS))
    assert not missing, f"add these to blockd.auth.policy: {missing}"
    assert sorted(set(METHOD_PERMISSIONS) - paths) == []
    assert set(METHOD_PERMISSIONS.values()) <= {*PERMISSIONS, OPEN, AUTHENTICATED}


def test_roles_and_their_permissions() -> None:
    assert ROLE_PERMISSIONS["admin"] == frozenset(PERMISSIONS)
    assert required_permission("/blockd.v1.KVShardService/WriteKV") in ROLE_PERMISSIONS["scheduler"]
    assert required_permission("/blockd.v1.KVShardService/WriteKV") not in ROLE_PERMISSIONS["reader"]
    assert required_permission("/blockd.v1.BlockService/Watch") in ROLE_PERMISSIONS["worker"]
    for method in ("Events", "LookupPrefix", "Step"):  # a worker never sees prompts nor steps
        assert required_permission(f"/blockd.v1.BlockService/{method}") not in ROLE_PERMISSIONS["worker"]
    assert required_permission("/blockd.v1.PoolService/CreatePool") not in ROLE_PERMISSIONS["scheduler"]
    with pytest.raises(UnknownMethod):
        required_permission("/blockd.v1.PoolService/Nope")


@pytest.fixture
def guarded(tmp_path, secure_server):
    """Plain text on loopback, with an identities file: every caller must authenticate."""
    path = str(tmp_path / "ids.json")
    add_token(path, "seed", "acme", ["reader"])
    return secure_server(None, path)


def test_every_rpc_without_credentials_is_unauthenticated_except_health(guarded) -> None:
    """Discovered from the descriptors: a new blockd RPC is checked without anyone listing it."""
    served = [(p, m) for p, m in ALL_METHODS if not p.startswith("/blockd.v1.KVShardService/")]
    with grpc.insecure_channel(guarded.address) as channel:
        for path, method in served:
            kind = ("stream" if method.client_streaming else "unary") + "_" + \
                   ("stream" if method.server_streaming else "unary")
            call = getattr(channel, kind)(path, request_serializer=bytes, response_deserializer=bytes)
            request = iter([b""]) if method.client_streaming else b""
            try:
                reply = call(request, timeout=10)
                if method.server_streaming:
                    next(iter(reply))
                code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                code = err.code()
            expected = grpc.StatusCode.OK if METHOD_PERMISSIONS[path] == OPEN else grpc.StatusCode.UNAUTHENTICATED
            assert code == expected, path
    assert guarded.engine.list_pools() == []


# --- identities --------------------------------------------------------------------------------------
def test_spiffe_uris_round_trip_and_malformed_ones_are_refused() -> None:
    uri = spiffe_uri("acme", ["scheduler", "reader"], "router-0")
    assert uri == "spiffe://blockd/tenant/acme/role/reader/role/scheduler/id/router-0"
    assert parse_spiffe_uri(uri) == Identity("router-0", "acme", frozenset({"reader", "scheduler"}))
    assert parse_spiffe_uri("spiffe://other-domain/tenant/a/role/admin/id/x") is None
    assert parse_spiffe_uri("https://blockd/tenant/a") is None
    for bad in ("spiffe://blockd/tenant/a/role/admin", "spiffe://blockd/tenant/a/role/admin/id/x/id/y",
                "spiffe://blockd/tenant/a/role/root/id/x", "spiffe://blockd/tenant/a b/role/admin/id/x",
                "spiffe://blockd/tenant/a/id/x"):
        with pytest.raises(BadIdentity):
            parse_spiffe_uri(bad)


def test_tenant_checks_read_the_current_identity() -> None:
    assert current_identity() is None
    require_tenant("anyone")  # no authentication configured: everything is allowed
    with acting_as(Identity("s", "acme", frozenset({"scheduler"}))):
        require_tenant("acme")
        assert visible_to_caller("acme") and not visible_to_caller("globex")
        with pytest.raises(AccessDenied, match="tenant 'acme'") as err:
            require_tenant("globex", "pool 'p'")
        assert "globex" not in str(err.value)  # never tell a prober who owns it
    with acting_as(Identity("o", "ops", frozenset({"admin"}))):
        require_tenant("globex")
    assert current_identity() is None


def test_access_denied_leaves_through_the_one_error_mapping_as_permission_denied() -> None:
    status = status_for(AccessDenied("pool 'p' does not belong to tenant 'acme'"), "Step")
    assert status.code == grpc.StatusCode.PERMISSION_DENIED and "tenant 'acme'" in status.details


# --- tokens ------------------------------------------------------------------------------------------
def test_token_file_add_list_remove(tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    token = add_token(path, "router-0", "acme", ["scheduler"])
    assert token.startswith("bkd_") and len(token) > 40
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        assert token not in f.read()
    registry = IdentityRegistry(path)
    assert registry.current.identity_for_token(token) == Identity("router-0", "acme", frozenset({"scheduler"}),
                                                                  "token")
    assert registry.current.identity_for_token(token + "x") is None
    with pytest.raises(IdentitiesFileError, match="exists"):
        add_token(path, "router-0", "acme", ["reader"])
    assert remove_token(path, "router-0") and not remove_token(path, "router-0")
    assert registry.reload() and registry.current.identity_for_token(token) is None


@pytest.mark.parametrize(("data", "message"), [
    ({"version": 2}, "version"),
    ({"version": 1, "tokens": [{"name": "a", "tenant": "t", "roles": ["admin"], "sha256": "xyz"}]}, "64"),
    ({"version": 1, "tokens": [{"name": "a", "tenant": "t", "roles": ["root"], "sha256": "0" * 64}]}, "roles"),
    ({"version": 1, "tokens": [{"name": "a", "tenant": "t", "roles": ["admin"], "sha256": "0" * 64},
                               {"name": "a", "tenant": "t", "roles": ["admin"], "sha256": "1" * 64}]},
     "duplicate"),
    ({"version": 1, "subjects": [{"name": "a", "tenant": "t", "roles": ["admin"]}]}, "cn"),
    ({"version": 1, "extra": 1}, "unknown keys"),
])
def test_malformed_identities_files_are_refused_with_the_entry_named(data, message) -> None:
    with pytest.raises(IdentitiesFileError, match=message):
        parse_identities(data, "ids.json")


def test_a_broken_file_on_reload_keeps_the_previous_identities(tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    token = add_token(path, "a", "acme", ["admin"])
    registry = IdentityRegistry(path)
    with open(path, "w") as f:
        f.write("{ half written")
    assert not registry.reload()
    assert registry.current.identity_for_token(token) is not None and registry.generation == 1


@pytest.mark.parametrize(("value", "token"), [("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc ", "abc")])
def test_bearer_tokens_are_read_from_the_authorization_metadata(value, token) -> None:
    class Item:
        def __init__(self, key, value):
            self.key, self.value = key, value

    assert bearer_token([Item("user-agent", "x"), Item("authorization", value)]) == token
    assert bearer_token([Item("user-agent", "x")]) is None
    for bad in ("Basic abc", "Bearer ", "abc"):
        with pytest.raises(Unauthenticated) as err:
            bearer_token([Item("authorization", bad)])
        assert "abc" not in err.value.message


def test_audit_lines_are_json_with_fixed_keys() -> None:
    when = dt.datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=dt.timezone.utc)
    line = audit_line("denied", "/blockd.v1.PoolService/DeletePool", "PERMISSION_DENIED",
                      Identity("dash", "acme", frozenset({"reader"}), "token"), "ipv4:127.0.0.1:5", "r" * 500,
                      now=when)
    record = json.loads(line)
    assert list(record) == ["time", "event", "method", "outcome", "identity", "tenant", "roles", "credential",
                            "peer", "reason"]
    assert record["time"] == "2025-01-02T03:04:05.678Z" and len(record["reason"]) == 300
    assert json.loads(audit_line("denied", "/m", "UNAUTHENTICATED", None, "p"))["identity"] is None


# --- flags and the loopback rule ---------------------------------------------------------------------
@pytest.mark.parametrize(("target", "loopback"), [
    ("127.0.0.1:50051", True), ("localhost:1", True), ("[::1]:5", True), ("127.8.9.1:5", True),
    ("dns:///localhost:5", True), ("0.0.0.0:50051", False), ("[::]:5", False), ("10.0.0.7:5", False),
    ("blockd.svc:5", False)])
def test_loopback_targets(target, loopback) -> None:
    assert is_loopback_target(target) is loopback


def test_plain_text_beyond_loopback_needs_insecure() -> None:
    with pytest.raises(InsecureListen, match=r"refusing to listen on 0\.0\.0\.0:1 without TLS.*--insecure"):
        check_listen("0.0.0.0:1", None, insecure=False)
    check_listen("0.0.0.0:1", None, insecure=True)
    check_listen("0.0.0.0:1", TlsConfig("c", "k"), insecure=False)
    check_listen("127.0.0.1:1", None, insecure=False)


def test_server_tls_flag_combinations() -> None:
    class Args:
        tls_cert = tls_key = tls_client_ca = None
        tls_require_client_cert = False

    args = Args()
    assert server_tls(args) is None
    args.tls_client_ca = "ca.pem"
    with pytest.raises(TlsError, match="mutual TLS is TLS first"):
        server_tls(args)
    args.tls_cert, args.tls_key = "c.pem", "k.pem"
    assert server_tls(args).mutual
    args.tls_client_ca, args.tls_require_client_cert = None, True
    with pytest.raises(TlsError, match="needs --tls-client-ca"):
        server_tls(args)
    with pytest.raises(TlsError, match="go together"):
        TlsConfig(cert="c.pem")


# --- what the package imports ----------------------------------------------------------------------
def test_auth_imports_nothing_of_the_engine_service_client_or_worker() -> None:
    code = ("import sys, pkgutil, importlib, blockd.auth;"
            "[importlib.import_module('blockd.auth.' + m.name) for m in pkgutil.iter_modules(blockd.auth.__path__)"
            " if m.name != '__main__'];"
            "bad = [m for m in sys.modules if m.startswith(('blockd.engine', 'blockd.service',"
            " 'client', 'worker', 'torch', 'prometheus_client'))];"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_flag_parsing_stays_free_of_grpc_and_cryptography() -> None:
    code = ("import sys, blockd.cli; blockd.cli.build_parser();"
            "print(','.join(m for m in ('grpc', 'cryptography') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_services_iterated_here_are_the_ones_the_servers_register() -> None:
    from blockd.engine.machine import Engine
    from blockd.rpc.stock import HEALTH, REFLECTION
    from blockd.service.server import BlockdServer
    from worker.service import SERVICE

    server = BlockdServer(Engine())
    try:
        served = {*server._endpoint.service_names, SERVICE.full_name, HEALTH.full_name, REFLECTION.full_name}
    finally:
        server.stop(0)
    assert {s.full_name for s in SERVED} == served
