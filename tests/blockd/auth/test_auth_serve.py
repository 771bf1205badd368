"""Security of a real ``blockd serve`` process: the plain-text refusal, mutual
TLS with ``blockctl``, tokens reloaded on SIGHUP and by ``blockd reload``, ``/metrics`` over TLS with
basic auth."""

from __future__ import annotations

import http.client
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode

import pytest

from blockd.auth import tokens
from blockd.cluster.local import free_port
from blockd.core import PoolConfig
from client.cli.common import Exit
from client.errors import UnauthenticatedError
from client.sdk import BlockdClient

pytest_plugins = ["tests.support.grpc_fixtures", "tests.support.auth_fixtures"]

RELOAD_TIMEOUT_S = 30.0


def test_plain_text_beyond_loopback_is_refused_and_says_why(run_module, tmp_path) -> None:
    data_dir = tmp_path / "data"
    proc = run_module("blockd.cli", "serve", "--listen", "0.0.0.0:0", "--data-dir", str(data_dir))
    assert proc.returncode == 2, proc.stderr
    assert "refusing to listen on 0.0.0.0:0 without TLS" in proc.stderr
    assert "--tls-cert" in proc.stderr and "--insecure" in proc.stderr and "Traceback" not in proc.stderr
    assert not data_dir.exists()  # refused before anything was opened
    env = run_module("blockd.cli", "serve", env={"BLOCKD_LISTEN": "[::]:0", "BLOCKD_TLS_CLIENT_CA": "ca.pem"})
    assert env.returncode == 2 and "--tls-client-ca needs --tls-cert and --tls-key" in env.stderr


def test_mutual_tls_serve_with_blockctl(daemon, run_module, pki) -> None:
    d = daemon("--listen", "127.0.0.1:0", "--tls-cert", pki.path("server"), "--tls-key", pki.key("server"),
               "--tls-client-ca", pki.ca, "--tls-require-client-cert")

    def blockctl(client: str | None, *args: str):
        tls = ["--tls-ca", pki.ca] + (["--tls-cert", pki.path(client), "--tls-key", pki.key(client)]
                                      if client else [])
        return run_module("client.cli", "--target", d.address, "--timeout-s", "5", *tls, *args)

    made = blockctl("admin", "pools", "create", "p", "--num-blocks", "8", "--block-size", "4")
    assert made.returncode == 0, made.stderr
    assert blockctl("reader", "--json", "pools", "list").returncode == 0
    denied = blockctl("reader", "pools", "delete", "p")
    assert denied.returncode == Exit.DENIED and "PERMISSION_DENIED" in denied.stderr
    assert blockctl(None, "pools", "list").returncode == Exit.UNAVAILABLE  # no client certificate
    assert blockctl("admin", "health").returncode == 0
    with BlockdClient(d.address, tls=pki.tls("admin")) as admin:
        assert [p.name for p in admin.list_pools()] == ["p"]
    assert d.stop() == 0
    audit = [line for line in d.output().splitlines() if "blockd.audit" in line]
    assert any('"method":"/blockd.v1.PoolService/CreatePool","outcome":"OK","identity":"admin-0"' in line
               for line in audit)
    assert any('"method":"/blockd.v1.PoolService/DeletePool","outcome":"PERMISSION_DENIED"' in line
               for line in audit)


def _wait_until_accepted(address: str, token: str) -> None:
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while True:
        with BlockdClient(address, token=token, timeout_s=5) as c:
            try:
                c.list_pools()
                return
            except UnauthenticatedError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.1)


def test_replication_without_peer_credentials_is_refused_before_anything_starts(run_module, tmp_path, pki) -> None:
    path = str(tmp_path / "ids.json")
    tokens.add_token(path, "ops", "acme", ["admin"])
    data_dir = tmp_path / "data"
    group = ("--data-dir", str(data_dir), "--etcd", "http://127.0.0.1:1", "--replica-id", "r0")
    server = ("--tls-cert", pki.path("server"), "--tls-key", pki.key("server"))
    for flags, wanted in [
        (("--tokens-file", path), "--etcd with --tokens-file needs --peer-token-file"),
        (server, "--etcd with --tls-cert needs --peer-tls-ca"),
        ((*server, "--tls-client-ca", pki.ca, "--peer-tls-ca", pki.ca),
         "--etcd with --tls-client-ca needs --peer-tls-cert and --peer-tls-key"),
        (("--tokens-file", path, "--peer-token-file", str(tmp_path / "missing")), "cannot read --peer-token-file"),
    ]:
        proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", *flags, *group)
        assert proc.returncode == 2, proc.stderr
        assert wanted in proc.stderr and "Traceback" not in proc.stderr
        assert not data_dir.exists()


def test_tokens_file_reloads_on_sighup(daemon, tmp_path) -> None:
    path = str(tmp_path / "ids.json")
    first = tokens.add_token(path, "ops", "acme", ["admin"])
    d = daemon("--listen", "127.0.0.1:0", "--tokens-file", path)
    with BlockdClient(d.address, token=first) as c:
        c.create_pool(PoolConfig("p", num_blocks=8, block_size=4))
    second = tokens.add_token(path, "ops-2", "acme", ["admin"])
    with BlockdClient(d.address, token=second) as c, pytest.raises(UnauthenticatedError):
        c.list_pools()  # not loaded yet: the file is read at start and on SIGHUP only
    os.kill(d.pid, signal.SIGHUP)
    _wait_until_accepted(d.address, second)
    tokens.remove_token(path, "ops")
    os.kill(d.pid, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    with BlockdClient(d.address, token=first, timeout_s=5) as c:
        while True:
            try:
                c.list_pools()
            except UnauthenticatedError:
                break
            assert time.monotonic() < deadline, "the removed token was still accepted"
            time.sleep(0.1)
    with BlockdClient(d.address) as anonymous, pytest.raises(UnauthenticatedError):
        anonymous.list_pools()
    assert d.stop() == 0
    assert "identities file" in d.output() and "reloaded: 1 tokens" in d.output()
    assert first not in d.output() and second not in d.output()


def test_blockd_reload_answers_only_once_the_daemon_has_reloaded(daemon, run_module, tmp_path) -> None:
    path, pid_file = str(tmp_path / "ids.json"), str(tmp_path / "blockd.pid")
    first = tokens.add_token(path, "ops", "acme", ["admin"])
    d = daemon("--listen", "127.0.0.1:0", "--tokens-file", path, "--pid-file", pid_file)
    second = tokens.add_token(path, "ops-2", "acme", ["admin"])
    done = run_module("blockd.cli", "reload", "--pid-file", pid_file)
    assert done.returncode == 0, done.stderr
    assert "reloaded: 2 tokens" in done.stdout
    with BlockdClient(d.address, token=second, timeout_s=5) as c:
        assert c.list_pools() == []  # at once, no retry: the answer came after the reload
    with open(path, "w") as f:
        f.write("{half an edit")
    broken = run_module("blockd.cli", "reload", "--pid-file", pid_file)
    assert broken.returncode == 1 and "the previous one stays in force" in broken.stdout
    assert "Traceback" not in broken.stderr
    with BlockdClient(d.address, token=first, timeout_s=5) as c:
        assert c.list_pools() == []  # the previous file is still in force
    assert d.stop() == 0
    assert not os.path.exists(pid_file) and not os.path.exists(pid_file + ".reload")
    stale = run_module("blockd.cli", "reload", "--pid-file", pid_file)
    assert stale.returncode == 1 and "is blockd serving with --pid-file" in stale.stderr


def test_blockd_reload_gives_up_on_a_process_that_does_not_answer(run_module, tmp_path) -> None:
    pid_file = tmp_path / "other.pid"
    deaf = subprocess.Popen([sys.executable, "-c", ("import signal, time; "
                             "signal.signal(signal.SIGHUP, signal.SIG_IGN); print('ready', flush=True); "
                             "time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert deaf.stdout.readline().strip() == "ready"  # ignores SIGHUP from here on
        pid_file.write_text(f"{deaf.pid}\n")
        proc = run_module("blockd.cli", "reload", "--pid-file", str(pid_file), "--timeout-s", "0.5")
        assert proc.returncode == 1 and "did not confirm a reload within 0.5s" in proc.stderr
        assert deaf.poll() is None
    finally:
        deaf.kill()
        deaf.wait()
    pid_file.write_text("not a pid\n")
    bad = run_module("blockd.cli", "reload", "--pid-file", str(pid_file))
    assert bad.returncode == 1 and "does not hold a process id" in bad.stderr and "Traceback" not in bad.stderr


def test_metrics_over_tls_with_basic_auth(daemon, pki, tmp_path) -> None:
    from blockd.auth.metrics_endpoint import add_user

    users = str(tmp_path / "users")
    password = add_user(users, "prometheus")
    port = free_port()
    d = daemon("--listen", "127.0.0.1:0", "--metrics-port", str(port), "--metrics-tls-cert", pki.path("server"),
               "--metrics-tls-key", pki.key("server"), "--metrics-basic-auth-file", users)
    context = ssl.create_default_context(cafile=pki.ca)
    url = f"https://127.0.0.1:{port}/metrics"

    def get(user: str, secret: str) -> int:
        request = urllib.request.Request(url, headers={
            "Authorization": "Basic " + b64encode(f"{user}:{secret}".encode()).decode()})
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as reply:
                assert b"blockd_rpc_duration_seconds" in reply.read()
                return reply.status
        except urllib.error.HTTPError as err:
            return err.code

    assert get("prometheus", password) == 200
    assert get("prometheus", "wrong") == 401
    assert get("nobody", password) == 401
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP is not served
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert d.stop() == 0


def test_a_worker_process_speaks_mutual_tls_both_ways_and_serves_only_its_tenant(daemon, tmp_path) -> None:
    """blockd-worker with one certificate (role worker, tenant acme, SAN
    127.0.0.1): it reads the pool from an mTLS blockd, registers, serves
    mutual TLS; acme's scheduler may use it, globex's may not, nobody without
    a certificate gets a connection."""
    from blockd.auth import TlsConfig
    from blockd.auth.certs import make_ca, make_client_cert, make_server_cert, write_pair
    from client.errors import PermissionDeniedError, UnavailableError
    from client.worker import WorkerClient
    from tests.support.procs import start_worker

    ca, d_ = make_ca(), str(tmp_path)
    write_pair(d_, "ca", ca)
    write_pair(d_, "server", make_server_cert(ca))
    for stem, tenant, role, hosts in [("admin", "ops", "admin", ()), ("worker", "acme", "worker", ("127.0.0.1",)),
                                      ("sched-a", "acme", "scheduler", ()), ("sched-g", "globex", "scheduler", ())]:
        write_pair(d_, stem, make_client_cert(ca, stem, tenant, (role,), hosts=hosts))

    def tls(stem: str | None) -> TlsConfig:
        ca_path = os.path.join(d_, "ca.pem")
        if stem is None:
            return TlsConfig(ca=ca_path)
        return TlsConfig(cert=os.path.join(d_, f"{stem}.pem"), key=os.path.join(d_, f"{stem}-key.pem"), ca=ca_path)

    server = tls("server")
    d = daemon("--tls-cert", server.cert, "--tls-key", server.key, "--tls-client-ca", server.ca)
    with BlockdClient(d.address, tls=tls("admin"), timeout_s=10) as admin:
        admin.create_pool(PoolConfig("p", num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4,
                                     dtype="float32", tenant="acme"))
        mine = tls("worker")
        worker = start_worker(d.address, "p", "--device", "cpu", "--worker-id", "w0", "--tls-cert", mine.cert,
                              "--tls-key", mine.key, "--tls-ca", mine.ca, "--tls-client-ca", mine.ca)
        try:
            with WorkerClient(worker.address, tls=tls("sched-a"), timeout_s=10) as client:
                assert client.stats().pool == "p"
            with WorkerClient(worker.address, tls=tls("sched-g"), timeout_s=10) as client, \
                    pytest.raises(PermissionDeniedError):
                client.stats()
            with WorkerClient(worker.address, tls=tls(None), timeout_s=10) as client, \
                    pytest.raises(UnavailableError):
                client.stats()
            assert [w.info.worker_id for w in admin.list_workers("p")] == ["w0"]
        finally:
            worker.kill()
