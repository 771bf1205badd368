"""Who is calling: :class:`Identity`, the certificate naming scheme, and the
per-call context the handlers and the engine read.

An identity is a name, a tenant and a set of roles (:mod:`blockd.auth.policy`
says what each role may do). It comes from one of two credentials
(:mod:`blockd.auth.interceptor` decides which):

* an mTLS client certificate whose URI SAN follows the blockd scheme::

      spiffe://<trust-domain>/tenant/<tenant>/role/<role>[/role/<role>...]/id/<name>

  e.g. ``spiffe://blockd/tenant/acme/role/scheduler/id/router-0``. The path is
  key/value pairs: exactly one ``tenant``, one ``id``, at least one ``role``.
  SPIFFE path segments allow letters, digits, ``.``, ``-`` and ``_``; tenant
  and name must fit :data:`NAME_RE`. A certificate without such a SAN is
  mapped by its subject CN through the identities file (``subjects``);
* a bearer token (``authorization: Bearer <token>``) looked up in the same
  file by its hash (:mod:`blockd.auth.tokens`).

The identity of the call being served is held in a :mod:`contextvars`
variable set by the interceptor: :func:`current_identity` reads it (None when
the server runs without authentication), :func:`require_tenant` is the check
the engine makes once it knows a pool's owner, raising :class:`AccessDenied`
(PERMISSION_DENIED through the one error mapping, like every core error).

Imports the standard library and the core (its errors and its name rule) only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from blockd.core.errors import BlockdError
from blockd.core.validate import SAFE_NAME_RE

#: the roles there are; :mod:`blockd.auth.policy` gives each its permissions
ROLES = ("admin", "scheduler", "worker", "reader")
#: tenant and identity names: short, printable, safe in a SPIFFE path and in a log line (the core's rule)
NAME_RE = SAFE_NAME_RE
DEFAULT_TRUST_DOMAIN = "blockd"
_SCHEME = "spiffe://"


class AccessDenied(BlockdError):
    """The caller is known but may not do this (wrong role or wrong tenant).

    A core-style error so it leaves through blockd's one error mapping as
    PERMISSION_DENIED with an ``ErrorInfo`` reason ``ACCESS_DENIED``."""

    code = "PERMISSION_DENIED"


class BadIdentity(ValueError):
    """A credential that names no valid identity (malformed SAN, bad entry)."""


def check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise BadIdentity(f"{what} must be 1-128 of letters, digits, '.', '-', '_' (starting with a letter "
                          f"or digit), got {value!r:.80}")
    return value


def check_roles(roles) -> frozenset[str]:
    roles = frozenset(roles)
    unknown = sorted(roles - set(ROLES))
    if unknown or not roles:
        raise BadIdentity(f"roles must be a non-empty subset of {', '.join(ROLES)}; got {sorted(roles)}")
    return roles


@dataclass(frozen=True)
class Identity:
    """A caller: ``name`` (for logs and audit), ``tenant`` (whose pools it may
    touch), ``roles`` (what it may do there; ``admin`` may do anything, on
    any tenant). ``source`` says which credential proved it: ``cert`` or
    ``token`` (never the credential itself)."""

    name: str
    tenant: str
    roles: frozenset[str]
    source: str = "cert"

    def __post_init__(self) -> None:
        check_name(self.name, "identity name")
        check_name(self.tenant, "tenant")
        object.__setattr__(self, "roles", check_roles(self.roles))

    @property
    def is_admin(self) -> bool:
        return "admin" in self.roles

    def may_access_tenant(self, tenant: str) -> bool:
        return self.is_admin or tenant == self.tenant

    def describe(self) -> str:
        """``name@tenant (roles)``: for messages and audit lines."""
        return f"{self.name}@{self.tenant} ({','.join(sorted(self.roles))})"


def spiffe_uri(tenant: str, roles, name: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> str:
    """The URI SAN that names an identity (the inverse of :func:`parse_spiffe_uri`)."""
    check_name(tenant, "tenant")
    check_name(name, "identity name")
    role_path = "".join(f"/role/{role}" for role in sorted(check_roles(roles)))
    return f"{_SCHEME}{trust_domain}/tenant/{tenant}{role_path}/id/{name}"


def parse_spiffe_uri(uri: str, trust_domain: str = DEFAULT_TRUST_DOMAIN) -> Identity | None:
    """The identity a blockd URI SAN names; None for a URI of another trust
    domain or scheme (not ours to read); :class:`BadIdentity` for one of
    ours that is malformed (never silently ignored: the CA signed it)."""
    prefix = f"{_SCHEME}{trust_domain}/"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix):].split("/")
    if len(parts) % 2:
        raise BadIdentity(f"certificate URI {uri!r:.200} is not key/value pairs (tenant/T/role/R/id/N)")
    fields: dict[str, list[str]] = {}
    for key, value in zip(parts[::2], parts[1::2]):
        fields.setdefault(key, []).append(value)
    if set(fields) != {"tenant", "role", "id"} or len(fields["tenant"]) != 1 or len(fields["id"]) != 1:
        raise BadIdentity(f"certificate URI {uri!r:.200} must name one tenant, one id and at least one role")
    try:
        return Identity(fields["id"][0], fields["tenant"][0], frozenset(fields["role"]), "cert")
    except BadIdentity as err:
        raise BadIdentity(f"certificate URI {uri!r:.200}: {err}") from None


_current: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("blockd_identity", default=None)


def current_identity() -> Identity | None:
    """The identity of the call being served on this thread; None when the
    server authenticates nobody (loopback development without credentials)."""
    return _current.get()


def bind_identity(identity: Identity | None) -> None:
    """Make ``identity`` the current caller for the rest of this call.

    gRPC's sync server runs every RPC (interceptors, handler, and each step
    of a response stream) in a fresh :class:`contextvars.Context` of its own,
    so a value set here lives exactly as long as the call and never leaks
    into the next call served by the same thread."""
    _current.set(identity)


@contextlib.contextmanager
def acting_as(identity: Identity | None) -> Iterator[None]:
    """Run a block as ``identity`` outside gRPC (tests, in-process callers)."""
    token = _current.set(identity)
    try:
        yield
    finally:
        _current.reset(token)


def require_tenant(tenant: str, what: str = "this pool") -> None:
    """Refuse (:class:`AccessDenied`) unless the current caller may touch
    ``tenant``'s resources. No identity (authentication off) allows all.

    The message names the caller's tenant, never the owner's (which would
    tell a prober who owns a pool name)."""
    identity = _current.get()
    if identity is not None and not identity.may_access_tenant(tenant):
        raise AccessDenied(f"{what} does not belong to tenant {identity.tenant!r}; "
                           f"{identity.name!r} may only use its own tenant's pools")


def visible_to_caller(tenant: str) -> bool:
    """Whether the current caller may see ``tenant``'s resources (for listings
    that filter rather than refuse)."""
    identity = _current.get()
    return identity is None or identity.may_access_tenant(tenant)
