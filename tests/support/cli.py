"""``blockctl`` run in process for tests: its exit status and what it printed."""

from __future__ import annotations

from client.cli import main as blockctl


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``blockctl ARGV`` -> (exit status, stdout, stderr), read through pytest's ``capsys``."""
    code = blockctl(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
