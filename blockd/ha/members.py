"""A replica's member key, ``/blockd/<group>/members/<replica-id>``.

Bound to the replica's lease, so it vanishes with the replica (or with a
lease it abandoned: the next write goes under the new one). Rewritten when
what it says changes (when only the log position moved, at most every
:data:`PROGRESS_EVERY_S`), and at least every ``refresh_s`` so that its
``updated_unix_s`` shows the replica is alive; never more often than the
election's cycle. Progress (applied LSN, lag) comes from the engine through
:meth:`MemberReport.set_progress`, from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from blockd.ha.etcd import EtcdClient
from blockd.ha.keys import MemberInfo

#: how often a member key is rewritten when only its log position moved
PROGRESS_EVERY_S = 1.0


class MemberReport:
    """What one replica says about itself, and when it last wrote it."""

    def __init__(self, key: str, replica_id: str, address: str, refresh_s: float,
                 clock: Callable[[], float]) -> None:
        self._key, self._replica_id, self._address = key, replica_id, address
        self._refresh_s, self._clock = refresh_s, clock
        self._lock = threading.Lock()
        self._progress = (0, -1)
        self._written: tuple[MemberInfo, int, float] | None = None  # what, under which lease, when

    def set_progress(self, applied_lsn: int, lag_records: int = -1) -> None:
        if applied_lsn < 0 or lag_records < -1:
            raise ValueError(f"applied_lsn must be >= 0 and lag_records >= -1, got {applied_lsn}, {lag_records}")
        with self._lock:
            self._progress = (applied_lsn, lag_records)

    def publish(self, kv: EtcdClient, lease_id: int, role: str, term: int, timeout_s: float) -> None:
        """Write the key under ``lease_id`` if it changed, moved lease or is due for a refresh."""
        with self._lock:
            applied, lag = self._progress
        info = MemberInfo(self._replica_id, self._address, role, term, applied, lag)
        now = self._clock()
        if self._written is not None:
            written, lease, at = self._written
            if written == info and lease == lease_id and now < at + self._refresh_s:
                return
            # only the log position moved: it moves with every step, and a put every cycle cost a
            # busy leader about a tenth of its CPU; status may trail it by PROGRESS_EVERY_S
            if (lease == lease_id and now < at + PROGRESS_EVERY_S
                    and replace(written, applied_lsn=applied, lag_records=lag) == info):
                return
        kv.put(self._key, replace(info, updated_unix_s=round(time.time(), 3)).encode(), lease_id, timeout_s)
        self._written = (info, lease_id, now)
