"""``blockd.threads``: the OS sees the name blockd gives its own threads."""

from __future__ import annotations

import sys
import threading

import pytest

from blockd.threads import MAX_NAME_BYTES, name_os_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_a_named_thread_shows_its_name_in_proc():
    seen: list[str] = []

    def run() -> None:
        assert name_os_thread("blockd-test-thread-with-a-long-name")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    # the kernel keeps 15 bytes: the name is cut, never refused
    assert seen == ["blockd-test-thread-with-a-long-name"[:MAX_NAME_BYTES]]
