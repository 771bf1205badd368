"""Audit lines: one JSON object per admin action and per refused call.

Written at INFO to the ``blockd.audit`` logger (the daemon's log by default;
route that logger to a file or a collector to keep them apart). Each line
is a JSON object with, in this order:

==============  =================================================================
key             value
==============  =================================================================
``time``        UTC, RFC 3339 with milliseconds
``event``       ``admin`` (an admin action, allowed or not) or ``denied``
``method``      the gRPC method path, ``/blockd.v1.PoolService/CreatePool``
``outcome``     the status code name: ``OK``, ``UNAUTHENTICATED``, ``PERMISSION_DENIED``, ...
``identity``    the caller's name, or null when it could not be established
``tenant``      the caller's tenant, or null
``roles``       the caller's roles (sorted), or []
``credential``  ``cert``, ``token`` or null: which kind proved the identity
``peer``        gRPC's peer string, ``ipv4:10.0.0.7:51234``
``reason``      why it was refused (blockd's own words), or null
==============  =================================================================

Never a secret: tokens, keys and certificates are not passed in here, and
the reasons are written by blockd, never copied from a request. Imports the
standard library only.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

from blockd.auth.identity import Identity

AUDIT_LOGGER = "blockd.audit"
#: longest reason written (an engine's refusal message, cut)
MAX_REASON_CHARS = 300

log = logging.getLogger(AUDIT_LOGGER)


def audit_line(event: str, method: str, outcome: str, identity: Identity | None, peer: str,
               reason: str | None = None, *, now: dt.datetime | None = None) -> str:
    """The JSON text of one audit line (see the module docstring)."""
    when = now if now is not None else dt.datetime.now(dt.timezone.utc)
    record = {
        "time": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
        "event": event,
        "method": method,
        "outcome": outcome,
        "identity": identity.name if identity else None,
        "tenant": identity.tenant if identity else None,
        "roles": sorted(identity.roles) if identity else [],
        "credential": identity.source if identity else None,
        "peer": peer,
        "reason": reason[:MAX_REASON_CHARS] if reason else None,
    }
    return json.dumps(record, ensure_ascii=True, separators=(",", ":"))


def write(event: str, method: str, outcome: str, identity: Identity | None, peer: str,
          reason: str | None = None) -> None:
    """Log one audit line at INFO on ``blockd.audit``."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", audit_line(event, method, outcome, identity, peer, reason))
