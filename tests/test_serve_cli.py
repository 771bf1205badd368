"""``blockd`` as a user runs it: bad arguments to ``serve`` are named as what
they are (one line, exit 2), ``--version``, ``python -m blockd``, and
``--log-format json``. Real processes (:func:`tests.grpc_fixtures.run_module`)."""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.grpc_fixtures"]


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1", "host:port", "[::1", "127.0.0.1:70000"])
def test_a_malformed_listen_address_is_named_malformed(run_module, listen) -> None:
    proc = run_module("blockd.cli", "serve", "--listen", listen)
    assert proc.returncode == 2 and proc.stdout == ""
    line = _last_line(proc.stderr)
    assert line.startswith(f"blockd serve: error: argument --listen: malformed address {listen!r}: expected "
                           "HOST:PORT"), line
    assert "TLS" not in line


def test_a_malformed_listen_address_from_the_environment(run_module) -> None:
    proc = run_module("blockd.cli", "serve", env={"BLOCKD_LISTEN": "nonsense"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("blockd: BLOCKD_LISTEN: malformed address 'nonsense': expected HOST:PORT")


def test_a_data_dir_that_is_a_file_is_named_a_file(run_module, tmp_path) -> None:
    path = tmp_path / "state"
    path.write_text("not a directory\n")
    for data_dir in (path, path / "below"):
        proc = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
        assert proc.returncode == 2 and proc.stdout == ""
        line = _last_line(proc.stderr)
        assert line.startswith("blockd serve: error: argument --data-dir: ") and \
            f"{str(path)!r}" in line and line.endswith("is a file, not a directory"), line
        assert "Errno" not in proc.stderr
    assert path.read_text() == "not a directory\n"
    proc = run_module("blockd.cli", "serve", env={"BLOCKD_DATA_DIR": str(path)})
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"blockd: BLOCKD_DATA_DIR: {str(path)!r} is a file, not a directory")
