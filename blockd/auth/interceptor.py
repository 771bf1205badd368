"""The one layer that authenticates and authorizes every call:
:class:`AuthInterceptor`, a ``grpc.ServerInterceptor``.

For each call, before the handler runs:

1. **who** (:meth:`Authenticator.authenticate`): a bearer token in the
   ``authorization`` metadata, when one is sent, decides (a per-call
   credential is more specific than the connection's, and a bad one is
   refused rather than silently replaced by the certificate); otherwise the
   mTLS client certificate: its blockd URI SAN (``peer_uri`` in gRPC's auth
   context), else its subject CN looked up in the identities file. Nothing
   usable: UNAUTHENTICATED;
2. **may it** (:mod:`blockd.auth.policy`): the method's permission must be
   among the roles' (PERMISSION_DENIED otherwise). A method the policy does
   not list is refused (a test keeps the table complete);
3. the identity is bound to the call (:func:`blockd.auth.identity.current_identity`)
   for the engine's tenant checks, whose refusals
   (:class:`~blockd.auth.identity.AccessDenied`) leave through blockd's one
   error mapping as PERMISSION_DENIED.

Afterwards it writes an audit line (:mod:`blockd.auth.audit`) for every
admin action and every refused call, its own refusals and the handler's
PERMISSION_DENIED alike. Refusals carry a ``google.rpc.ErrorInfo`` (domain
``blockd``, reason ``UNAUTHENTICATED`` or ``ACCESS_DENIED``) and a message
that says what to do; no message or audit line repeats a credential.

Health (``open`` in the policy) is passed through untouched. Wrapped
handlers are cached per method, and identities per certificate, so the
cost per call is a metadata scan, a dict lookup or a SHA-256 of the token,
and a contextvar set (``bench/auth.py`` measures it).

Imports the standard library, grpc and grpcio-status (for the google.rpc
details); never the engine or the service layer.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from blockd.auth import audit
from blockd.auth.identity import ROLES, BadIdentity, Identity, bind_identity, parse_spiffe_uri
from blockd.auth.policy import ADMIN_PERMISSIONS, METHOD_PERMISSIONS, OPEN, allows, permissions_of
from blockd.auth.tokens import Identities, IdentityRegistry

log = logging.getLogger("blockd.auth")

_NO_IDENTITIES = Identities()
_CERT_CACHE_SIZE = 4096
_BEARER = "bearer "
_HANDLER_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler,
                  (False, True): grpc.unary_stream_rpc_method_handler,
                  (True, False): grpc.stream_unary_rpc_method_handler,
                  (True, True): grpc.stream_stream_rpc_method_handler}


class Unauthenticated(Exception):
    """No identity could be established; ``message`` is safe to send back."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def bearer_token(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, or None when
    there is none; :class:`Unauthenticated` for one that is malformed."""
    for item in metadata or ():
        if item.key != "authorization":
            continue
        value = item.value
        if isinstance(value, bytes) or not value[:len(_BEARER)].lower() == _BEARER or not value[len(_BEARER):]:
            raise Unauthenticated("the 'authorization' metadata must be 'Bearer <token>'")
        return value[len(_BEARER):].strip()
    return None


class Authenticator:
    """Maps a call's credentials to an :class:`Identity` (module docstring, step 1).

    ``registry``: the identities file (tokens and certificate subjects); None
    when only certificates with blockd URI SANs are accepted."""

    def __init__(self, registry: IdentityRegistry | None = None) -> None:
        self.registry = registry
        self._cert_cache: dict[tuple, Identity | Unauthenticated] = {}

    def _identities(self) -> tuple[Identities, int]:
        if self.registry is None:
            return _NO_IDENTITIES, 0
        return self.registry.current, self.registry.generation

    def authenticate(self, metadata, auth_context) -> Identity:
        """``auth_context``: a callable returning gRPC's auth context (only
        called when no token was sent: building it costs more than a token)."""
        identities, generation = self._identities()
        token = bearer_token(metadata)
        if token is not None:
            identity = identities.identity_for_token(token)
            if identity is None:
                raise Unauthenticated("the bearer token was not accepted (unknown, revoked or mistyped); "
                                      "ask the operator for a valid one")
            return identity
        context = auth_context()
        if context.get("transport_security_type") != [b"ssl"] or "x509_pem_cert" not in context:
            raise Unauthenticated("this call carries no credentials: connect with a client certificate "
                                  "(mutual TLS) or send 'authorization: Bearer <token>' metadata")
        key = (generation, tuple(context.get("peer_uri", ())), tuple(context.get("x509_common_name", ())))
        found = self._cert_cache.get(key)
        if found is None:
            found = self._cert_identity(identities, key[1], key[2])
            if len(self._cert_cache) >= _CERT_CACHE_SIZE:
                self._cert_cache.clear()
            self._cert_cache[key] = found
        if isinstance(found, Unauthenticated):
            raise found
        return found

    @staticmethod
    def _cert_identity(identities: Identities, uris: tuple, common_names: tuple) -> Identity | Unauthenticated:
        for raw in uris:
            try:
                identity = parse_spiffe_uri(raw.decode("utf-8", "replace"), identities.trust_domain)
            except BadIdentity as err:
                return Unauthenticated(f"the client certificate names no valid blockd identity: {err}")
            if identity is not None:
                return identity
        for raw in common_names:
            identity = identities.identity_for_subject(raw.decode("utf-8", "replace"))
            if identity is not None:
                return identity
        cn = common_names[0].decode("utf-8", "replace")[:128] if common_names else ""
        return Unauthenticated(
            f"the client certificate (CN={cn!r}) names no blockd identity: issue it with a URI SAN "
            f"spiffe://{identities.trust_domain}/tenant/T/role/R/id/NAME, or map its CN in the identities file")


def _status(rpc_code: int, reason: str, message: str, method: str) -> grpc.Status:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="blockd",
                                          metadata={"rpc": method.rsplit("/", 1)[-1]}))
    return rpc_status.to_status(status_pb2.Status(code=rpc_code, message=message, details=[info]))


class AuthInterceptor(grpc.ServerInterceptor):
    """Authenticate, authorize, bind the identity, audit (module docstring)."""

    def __init__(self, authenticator: Authenticator, permissions=METHOD_PERMISSIONS) -> None:
        self.authenticator = authenticator
        self._permissions = permissions
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        permission = self._permissions.get(method)
        if permission == OPEN:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method, permission)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    # --- per call -------------------------------------------------------------------------
    def _admit(self, method: str, permission: str | None, context: grpc.ServicerContext) -> Identity:
        """The caller's identity, or abort the call (UNAUTHENTICATED / PERMISSION_DENIED)."""
        try:
            identity = self.authenticator.authenticate(context.invocation_metadata(), context.auth_context)
        except Unauthenticated as err:
            self._refuse(context, method, None, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", err.message)
        if permission is None:
            log.error("no permission is defined for %s: refused (add it to blockd.auth.policy)", method)
            self._refuse(context, method, identity, grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED",
                         f"blockd has no access rule for {method} and refuses what it has no rule for")
        if not allows(identity.roles, permission):
            roles = [role for role in ROLES if permission in permissions_of([role])]
            self._refuse(context, method, identity, grpc.StatusCode.PERMISSION_DENIED, "ACCESS_DENIED",
                         f"{identity.describe()} may not call {method.rsplit('/', 1)[-1]}: it needs "
                         f"{permission!r}, which roles {', '.join(roles)} have")
        bind_identity(identity)
        return identity

    def _refuse(self, context, method: str, identity: Identity | None, code: grpc.StatusCode, reason: str,
                message: str) -> NoReturn:
        audit.write("denied", method, code.name, identity, context.peer(), message)
        rpc_code = code_pb2.UNAUTHENTICATED if code is grpc.StatusCode.UNAUTHENTICATED \
            else code_pb2.PERMISSION_DENIED
        context.abort_with_status(_status(rpc_code, reason, message, method))
        raise AssertionError("abort_with_status returned")  # gRPC's abort raises

    @staticmethod
    def _after(context, method: str, identity: Identity, is_admin: bool, failed: bool) -> None:
        """Audit an admin action's outcome, or a refusal by the handler (tenant checks)."""
        code = context.code()
        name = code.name if code is not None else ("UNKNOWN" if failed else "OK")
        if is_admin or name == "PERMISSION_DENIED":
            reason = None
            if name != "OK":
                details = context.details()
                reason = details.decode("utf-8", "replace") if isinstance(details, bytes) else details
            event = "denied" if name == "PERMISSION_DENIED" else "admin"
            audit.write(event, method, name, identity, context.peer(), reason)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, permission: str | None):
        admit, after = self._admit, self._after
        is_admin = permission in ADMIN_PERMISSIONS
        streaming_response = handler.response_streaming
        behavior = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
                    (True, False): handler.stream_unary, (True, True): handler.stream_stream}[
            (handler.request_streaming, streaming_response)]
        assert behavior is not None  # gRPC sets the one matching the handler's kind

        def unary_response(request, context):
            identity = admit(method, permission, context)
            failed = True
            try:
                response = behavior(request, context)
                failed = False
                return response
            finally:
                after(context, method, identity, is_admin, failed)

        def stream_response(request, context):
            identity = admit(method, permission, context)
            failed = True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                after(context, method, identity, is_admin, failed)

        make = _HANDLER_KINDS[(handler.request_streaming, streaming_response)]
        return make(stream_response if streaming_response else unary_response,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
