"""The engine's calls on a prefix cache: reset, pins, their deadlines, and the timer that lets expired pins go.

A pin (:class:`blockd.core.Pin`) holds a prefix's full blocks cached in the
device tier the way a table does, so they stay used and are never evicted;
the allocator knows nothing else of pins. This module is the engine's side:

* :class:`CacheCalls`, mixed into :class:`blockd.engine.machine.Engine`:
  ``reset_prefix_cache`` (which drops every pin of the pool with the cache),
  ``pin_prefix``, ``unpin_prefix``, ``list_pins``, ``expire_pins``,
  ``set_prefix_priority`` (a prefix's cached blocks at a retention priority,
  in both tiers: :meth:`blockd.core.Pool.set_prefix_priority`), and
  ``retain_committed`` (after each live step: pins for the ``Allocate`` ops
  that set ``retain_ttl_s``, :mod:`blockd.engine.retention.retain`). A pin
  and an unpin are records (:mod:`blockd.engine.records`) like any change:
  the leader gate, request ids, the tenant's check and quota
  (``pinned_blocks``: distinct pinned blocks of all its pools), the log;
* deadlines: a pin with a TTL carries ``expires_at``, the leader's wall clock
  (``EngineConfig.wall_clock``) plus the TTL, stamped once into its record.
  :meth:`CacheCalls.expire_pins` logs an ``unpin_prefix`` record (``expired``)
  for each pin past its deadline, so replay and followers apply the same
  unpins and never read a clock; a pin whose deadline passed while the daemon
  was down goes at the first run after it starts;
* :class:`PinExpiry`: the thread that calls ``expire_pins`` every
  :data:`EXPIRY_INTERVAL_S` (started and stopped by the gRPC server). A
  follower's engine refuses the unpins (it does not lead) and lets them be.

Imports the core and the engine's state and tenancy, never the machine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from blockd.core import BlockdError, ExtraKeys, Pin, PrefixPriority
from blockd.core.errors import QuotaExceeded
from blockd.core.validate import check_priority
from blockd.engine import records
from blockd.engine.pools import PoolEntry
from blockd.engine.retention.retain import check_ttl, due_pins
from blockd.engine.tenancy import owner_of

if TYPE_CHECKING:
    from blockd.engine.config import EngineConfig
    from blockd.engine.state import State
    from blockd.engine.tenancy import Tenancy

log = logging.getLogger("blockd.engine.retention.pins")

#: how often the daemon looks for pins past their deadline
EXPIRY_INTERVAL_S = 0.2


class CacheCalls:
    """The engine's calls on a pool's prefix cache; :class:`~blockd.engine.machine.Engine`
    provides what is declared here (its state, tenancy, config and change path)."""

    if TYPE_CHECKING:
        _state: State
        _tenancy: Tenancy
        _lock: threading.RLock
        config: EngineConfig

        def _guard(self, name: object) -> None: ...
        def _mutate_in_term(self, record: records.Record, rid: str = "",
                            check: Callable[[], object] | None = None) -> tuple[object, int]: ...
        def _read(self, read: Callable[[], Any]) -> Any: ...

    def reset_prefix_cache(self, pool: str, request_id: str = "") -> None:
        """Drop every cached hash of ``pool``, in both tiers, and every pin of it."""
        self._guard(pool)
        self._mutate_in_term(records.ResetPrefixCache(pool), request_id)

    def pin_prefix(self, pool: str, token_ids: list[int], extra_keys: ExtraKeys, ttl_s: float = 0.0,
                   request_id: str = "") -> Pin:
        """Pin the leading full blocks of ``token_ids`` cached in ``pool``'s
        device tier (FAILED_PRECONDITION if there are none); ``ttl_s`` > 0:
        let go that many seconds from now."""
        self._guard(pool)
        ttl = check_ttl(ttl_s)
        expires_at = self.config.wall_clock() + ttl if ttl else 0.0
        record = records.PinPrefix(pool, list(token_ids) if isinstance(token_ids, (list, tuple)) else token_ids,
                                   extra_keys, ttl, expires_at)

        def check() -> None:  # a pin over the tenant's quota changes nothing
            self._check_pin_quota(self._state.entry(pool), record)

        pin = self._mutate_in_term(record, request_id, check)[0]
        assert isinstance(pin, Pin), "a pin record answers with its pin"
        return pin

    def _check_pin_quota(self, entry: PoolEntry, record: records.PinPrefix) -> None:
        """QUOTA_EXCEEDED if ``record`` would take its tenant past its pinned blocks."""
        config = entry.pool.config
        tenant = owner_of(config)
        held = sum(len(e.pool.pinned) for e in self._state.pools.values() if owner_of(e.pool.config) == tenant)
        more = sum(1 for block in dict.fromkeys(entry.pool.pinnable(record.token_ids, record.extra_keys))
                   if block not in entry.pool.pinned)
        self._tenancy.check_pins(config, held, more)

    def retain_committed(self, pool: str) -> None:
        """After a live step of ``pool``: pin the prompts of its sequences whose
        ``Allocate`` asked to retain them and that are now committed, and drop
        the requests of sequences gone (:mod:`blockd.engine.retention.retain`).
        A pin over the tenant's quota is given up (logged as such)."""
        with self._lock:
            entry = self._state.pools.get(pool)
            if entry is None or not entry.retain:
                return
            for due in list(due_pins(entry, self.config.wall_clock())):
                record = due
                if due.token_ids:
                    try:
                        self._check_pin_quota(entry, due)
                    except QuotaExceeded as err:
                        log.warning("pool %r: sequence %r's prompt is not retained: %s", pool, due.seq_id, err)
                        record = replace(due, token_ids=[])
                try:
                    self._mutate_in_term(record)
                except BlockdError as err:  # this replica no longer leads, or the log is broken: its leader retries
                    log.debug("pool %r: retaining %r not logged here: %s", pool, record.seq_id, err)
                    return

    def unpin_prefix(self, pool: str, pin_id: str, request_id: str = "") -> Pin:
        """Let pin ``pin_id`` of ``pool`` go (NOT_FOUND if it holds none such)."""
        self._guard(pool)
        pin = self._mutate_in_term(records.UnpinPrefix(pool, pin_id), request_id)[0]
        assert isinstance(pin, Pin), "an unpin record answers with the pin"
        return pin

    def set_prefix_priority(self, pool: str, token_ids: list[int], extra_keys: ExtraKeys, priority: int,
                            request_id: str = "") -> PrefixPriority:
        """Keep the leading full blocks of ``token_ids`` cached in ``pool``
        (either tier) at retention ``priority`` (INVALID_ARGUMENT out of
        range, FAILED_PRECONDITION when none is cached; nothing changes)."""
        self._guard(pool)
        check_priority(priority)  # before the record: a bad priority is never logged
        record = records.SetPrefixPriority(pool, list(token_ids) if isinstance(token_ids, (list, tuple))
                                           else token_ids, extra_keys, priority)
        done = self._mutate_in_term(record, request_id)[0]
        assert isinstance(done, PrefixPriority), "a priority record answers with what it set"
        return done

    def list_pins(self, pool: str) -> list[Pin]:
        """``pool``'s pins, in the order they were made."""
        pins: list[Pin] = self._read(lambda: list(self._state.entry(pool).pool.pins.values()))
        return pins

    def expire_pins(self) -> int:
        """Log an unpin of every pin past its deadline now; how many went. A
        replica that does not lead unpins nothing (its leader does)."""
        now = self.config.wall_clock()
        with self._lock:
            due = [(name, pin.pin_id) for name, entry in self._state.pools.items()
                   for pin in entry.pool.pins.values() if pin.expires_at and pin.expires_at <= now]
        done = 0
        for name, pin_id in due:
            try:
                self._mutate_in_term(records.UnpinPrefix(name, pin_id, expired=True))
            except BlockdError as err:  # unpinned or deleted meanwhile, or this replica no longer leads
                log.debug("pin %s of pool %r not expired here: %s", pin_id, name, err)
                continue
            done += 1
            log.info("pool %r: pin %s expired and was let go", name, pin_id)
        return done


class PinExpiry:
    """Calls ``expire`` every ``interval_s`` on a daemon thread until :meth:`stop`."""

    def __init__(self, expire: Callable[[], object], interval_s: float = EXPIRY_INTERVAL_S) -> None:
        self._expire = expire
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blockd-pin-expiry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._expire()
            except Exception:  # a bug must not end expiry for good: say so and go on
                log.exception("expiring pins failed")
