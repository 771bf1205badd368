"""The identities file: bearer tokens (stored hashed) and certificate subjects.

One JSON file, read by ``blockd serve --tokens-file`` and re-read on SIGHUP
(:meth:`IdentityRegistry.reload`)::

    {
      "version": 1,
      "trust_domain": "blockd",
      "tokens": [
        {"name": "router-0", "tenant": "acme", "roles": ["scheduler"],
         "sha256": "9f86d0...", "created": "2025-01-31T12:00:00Z"}
      ],
      "subjects": [
        {"cn": "kv-worker-3.acme.internal", "name": "worker-3", "tenant": "acme", "roles": ["worker"]}
      ],
      "quotas": {"*": {"pools": 4, "blocks": 65536}, "acme": {"pools": 16, "steps_per_s": 1000}}
    }

``tokens``: what a bearer token proves. Tokens are 256 random bits
(:func:`new_token`, ``bkd_`` + 43 URL-safe characters; the prefix lets
secret scanners spot a leaked one); the file holds only their SHA-256.
A fast hash is right for such tokens: a slow KDF (scrypt, argon2) protects
low-entropy passwords against offline guessing, and nobody can guess 2^256;
it would also cost milliseconds on every call. A presented token is hashed
and looked up by its digest, then the digests are compared with
:func:`hmac.compare_digest`; the lookup's timing can only reveal the digest
of what the caller sent, which it knows already. Names are unique.

``subjects``: identities of client certificates that carry no blockd URI
SAN (a corporate CA's certificates, say), by their subject CN.

``quotas``: per-tenant limits (:mod:`blockd.auth.quotas`), reloaded with
the rest.

``trust_domain``: the SPIFFE trust domain of blockd URI SANs (default
``blockd``).

The file is written atomically (temporary file + rename, mode 0600) by the
token commands (:mod:`blockd.auth.cli`: ``blockd tokens add|list|remove``);
the token itself is printed once and never stored. Imports the standard
library only (and :mod:`blockd.auth.identity`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
from dataclasses import dataclass, field
from types import MappingProxyType

from blockd.auth.identity import DEFAULT_TRUST_DOMAIN, BadIdentity, Identity, check_name
from blockd.auth.quotas import Quota, QuotaFileError, parse_quotas, quota_for

log = logging.getLogger("blockd.auth")

FORMAT_VERSION = 1
TOKEN_PREFIX = "bkd_"
#: the longest token accepted: anything longer is refused before hashing
MAX_TOKEN_CHARS = 512


class IdentitiesFileError(ValueError):
    """The identities file cannot be read or is malformed; names the file and entry."""


def new_token() -> str:
    """A fresh bearer token: 256 random bits."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """The hex SHA-256 a token is stored as."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Identities:
    """One version of the identities file, immutable: a reload swaps in a new one."""

    tokens: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # digest -> (digest, Identity)
    subjects: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # cn -> Identity
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    entries: tuple = ()  # the raw token entries, for listing and rewriting
    quotas: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # tenant -> Quota

    def quota_for(self, tenant: str) -> Quota:
        """``tenant``'s limits (:func:`blockd.auth.quotas.quota_for`)."""
        return quota_for(self.quotas, tenant)

    def identity_for_token(self, token: str) -> Identity | None:
        if len(token) > MAX_TOKEN_CHARS:
            return None
        digest = token_digest(token)
        found = self.tokens.get(digest)
        if found is None:
            return None
        stored, identity = found
        # the lookup matched on the digest; the final comparison is constant-time all the same, so
        # the decision never rests on a short-circuiting comparison
        return identity if hmac.compare_digest(stored, digest) else None

    def identity_for_subject(self, common_name: str) -> Identity | None:
        return self.subjects.get(common_name)


def _entry_identity(entry, where: str, source: str) -> Identity:
    if not isinstance(entry, dict):
        raise IdentitiesFileError(f"{where}: must be an object")
    roles = entry.get("roles")
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise IdentitiesFileError(f"{where}: 'roles' must be a list of role names")
    try:
        return Identity(str(entry.get("name")), str(entry.get("tenant")), frozenset(roles), source)
    except BadIdentity as err:
        raise IdentitiesFileError(f"{where}: {err}") from None


def parse_identities(data: object, path: str = "<identities>") -> Identities:
    """Validate a decoded identities file; :class:`IdentitiesFileError` names what is wrong."""
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        raise IdentitiesFileError(f"{path}: must be a JSON object with \"version\": {FORMAT_VERSION}")
    unknown = sorted(set(data) - {"version", "trust_domain", "tokens", "subjects", "quotas"})
    if unknown:
        raise IdentitiesFileError(f"{path}: unknown keys {unknown}")
    trust_domain = data.get("trust_domain", DEFAULT_TRUST_DOMAIN)
    try:
        check_name(trust_domain, "trust_domain")
    except BadIdentity as err:
        raise IdentitiesFileError(f"{path}: {err}") from None
    tokens: dict[str, tuple[str, Identity]] = {}
    entries: list[dict] = []
    for i, entry in enumerate(data.get("tokens", [])):
        where = f"{path}: tokens[{i}]"
        identity = _entry_identity(entry, where, "token")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise IdentitiesFileError(f"{where}: 'sha256' must be 64 lowercase hex digits")
        if digest in tokens or any(e["name"] == identity.name for e in entries):
            raise IdentitiesFileError(f"{where}: duplicate token or name {identity.name!r}")
        tokens[digest] = (digest, identity)
        entries.append(dict(entry))
    subjects: dict[str, Identity] = {}
    for i, entry in enumerate(data.get("subjects", [])):
        where = f"{path}: subjects[{i}]"
        cn = entry.get("cn") if isinstance(entry, dict) else None
        if not isinstance(cn, str) or not cn or cn in subjects:
            raise IdentitiesFileError(f"{where}: 'cn' must be a non-empty string, unique in the file")
        subjects[cn] = _entry_identity(entry, where, "cert")
    try:
        quotas = parse_quotas(data.get("quotas"), path)
    except QuotaFileError as err:
        raise IdentitiesFileError(str(err)) from None
    return Identities(MappingProxyType(tokens), MappingProxyType(subjects), trust_domain, tuple(entries), quotas)


def load_identities(path: str) -> Identities:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise IdentitiesFileError(f"{path}: no such file") from None
    except (OSError, ValueError) as err:
        raise IdentitiesFileError(f"{path}: cannot read it as JSON: {err}") from None
    return parse_identities(data, path)


class IdentityRegistry:
    """The daemon's current :class:`Identities`, reloadable while serving.

    Readers take ``current`` (one attribute read; an :class:`Identities` is
    immutable), so a reload never blocks or tears a call. ``generation``
    counts successful loads (caches key on it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.current = load_identities(path)
        self.generation = 1
        self.last_reload = f"identities file {path} loaded at start"

    def reload(self) -> bool:
        """Re-read the file. On any error keep serving the previous version and
        log why (a half-edited file must not lock everyone out); True when the
        new one took effect. ``last_reload`` says what happened, in words
        (``blockd reload`` prints it)."""
        with self._lock:
            try:
                fresh = load_identities(self.path)
            except IdentitiesFileError as err:
                self.last_reload = f"identities file not reloaded, the previous one stays in force: {err}"
                log.error("%s", self.last_reload)
                return False
            self.current = fresh
            self.generation += 1
            self.last_reload = (f"identities file {self.path} reloaded: {len(fresh.tokens)} tokens, "
                                f"{len(fresh.subjects)} certificate subjects, {len(fresh.quotas)} quotas")
        log.info("%s", self.last_reload)
        return True


# --- editing the file (the token commands) ------------------------------------------------
def read_for_edit(path: str) -> dict:
    """The file's JSON, validated; a missing file is an empty one."""
    if not os.path.exists(path):
        return {"version": FORMAT_VERSION, "tokens": [], "subjects": []}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    parse_identities(data, path)
    return data


def write_atomically(path: str, data: dict) -> None:
    """Validate, then replace ``path`` in one rename (mode 0600): a daemon
    reloading meanwhile reads the old file or the new one, never half."""
    parse_identities(data, path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".identities-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def add_token(path: str, name: str, tenant: str, roles) -> str:
    """Create a token for ``name@tenant`` with ``roles``, store its hash in
    ``path`` and return the token (the only time anyone sees it)."""
    data = read_for_edit(path)
    if any(e.get("name") == name for e in data.get("tokens", [])):
        raise IdentitiesFileError(f"{path}: a token named {name!r} exists; remove it first")
    token = new_token()
    created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    data.setdefault("tokens", []).append({"name": name, "tenant": tenant, "roles": sorted(set(roles)),
                                          "sha256": token_digest(token), "created": created})
    write_atomically(path, data)
    return token


def remove_token(path: str, name: str) -> bool:
    """Revoke the token named ``name``; False when there is none."""
    data = read_for_edit(path)
    kept = [e for e in data.get("tokens", []) if e.get("name") != name]
    if len(kept) == len(data.get("tokens", [])):
        return False
    data["tokens"] = kept
    write_atomically(path, data)
    return True
