"""Per-tenant quotas: :class:`Quota`, and their section of the identities file.

The identities file (:mod:`blockd.auth.tokens`) may carry a ``quotas``
object, tenant name -> limits, with ``"*"`` for every tenant not named::

    "quotas": {
      "*":    {"pools": 4, "blocks": 65536, "steps_per_s": 200},
      "acme": {"pools": 16, "blocks": 1048576, "bytes": 85899345920, "sequences": 4096,
               "ops_per_step": 1024, "tokens_per_step": 65536, "steps_per_s": 1000}
    }

Every limit is optional (absent: unlimited):

===================  =====================================================================
limit                what it bounds
===================  =====================================================================
``pools``            pools the tenant owns
``blocks``           blocks of all its pools together (``num_blocks`` summed)
``bytes``            KV bytes of all its pools together (``num_blocks * bytes_per_block``
                     from each pool's geometry)
``sequences``        live sequences in all its pools together
``ops_per_step``     operations in one Step batch
``tokens_per_step``  token ids one Step batch carries (prompts, appends, decode tokens)
``steps_per_s``      Step calls per second (a token bucket holding one second's worth)
``pinned_blocks``    device blocks held by its pins in all its pools together (a block
                     two pins hold counts once; PinPrefix over it is refused)
===================  =====================================================================

The engine enforces them (:mod:`blockd.engine.tenancy`); exceeding one is
RESOURCE_EXHAUSTED with a ``google.rpc.QuotaFailure`` (and a ``RetryInfo``
for the step rate), and the refused call changes nothing. Quotas reload with
the file (SIGHUP). Bounding pools per tenant also bounds the pool names that
appear as metric labels. Imports the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import MappingProxyType

#: the quota section's key for every tenant without an entry of its own
ANY_TENANT = "*"


class QuotaFileError(ValueError):
    """A malformed ``quotas`` section; the message names the tenant and limit."""


@dataclass(frozen=True)
class Quota:
    """One tenant's limits; None is unlimited (module docstring)."""

    pools: int | None = None
    blocks: int | None = None
    bytes: int | None = None
    sequences: int | None = None
    ops_per_step: int | None = None
    tokens_per_step: int | None = None
    steps_per_s: float | None = None
    pinned_blocks: int | None = None


LIMITS = tuple(f.name for f in fields(Quota))
UNLIMITED = Quota()


def parse_quota(data: object, where: str) -> Quota:
    if not isinstance(data, dict):
        raise QuotaFileError(f"{where}: must be an object of limits ({', '.join(LIMITS)})")
    unknown = sorted(set(data) - set(LIMITS))
    if unknown:
        raise QuotaFileError(f"{where}: unknown limits {unknown}; the limits are {', '.join(LIMITS)}")
    for name, value in data.items():
        number = (int, float) if name == "steps_per_s" else (int,)
        if isinstance(value, bool) or not isinstance(value, number) or value < 0 or value > 1 << 62:
            raise QuotaFileError(f"{where}.{name}: must be a non-negative "
                                 f"{'number' if name == 'steps_per_s' else 'integer'}, got {value!r:.40}")
    return Quota(**data)


def parse_quotas(data: object, path: str) -> MappingProxyType:
    """tenant -> :class:`Quota` from the file's ``quotas`` object."""
    if data is None:
        return MappingProxyType({})
    if not isinstance(data, dict):
        raise QuotaFileError(f"{path}: 'quotas' must be an object: tenant -> limits")
    return MappingProxyType({str(tenant): parse_quota(limits, f"{path}: quotas[{tenant!r:.80}]")
                             for tenant, limits in data.items()})


def quota_for(quotas: MappingProxyType, tenant: str) -> Quota:
    """``tenant``'s quota: its own entry, else ``"*"``'s, else unlimited."""
    found = quotas.get(tenant)
    if found is None:
        found = quotas.get(ANY_TENANT, UNLIMITED)
    return found
