"""Advertised addresses: what a process tells others to dial, and whether they can.

A server binds one address (``0.0.0.0:50061`` in a container, so every
interface answers) and is reached at another (the pod IP, a host name).
``--advertise-address`` says the second; :func:`advertised` fills in its port
from the bound address when only a host is given (a pod spec knows its IP
from ``status.podIP`` but not the port a ``:0`` bind picked).

:func:`unroutable_reason` names what makes an address useless to another
host: the wildcard hosts ``0.0.0.0`` and ``::`` (they mean "every interface
here", and dialled from elsewhere reach the dialler itself), an empty host,
port 0. Loopback is accepted: it is right for a cluster on one machine.

Address syntax: ``HOST:PORT``; IPv6 hosts in brackets (``[fd00::1]:50061``).
A host alone may be a name, an IPv4 address or an IPv6 address with or
without brackets; a listen address (:func:`split_listen`) needs its port.
Standard library only (the worker registry imports it).
"""

from __future__ import annotations

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def split(address: str) -> tuple[str, int | None]:
    """``"host:port"`` -> ``("host", port)``; a host alone -> ``(host, None)``.
    IPv6 hosts come back without brackets. ``ValueError`` for a bad port."""
    text = address.strip()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"address {address!r}: an IPv6 host in brackets must be [HOST] or [HOST]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 host: any port needs brackets
        host, port_text = text, None
    else:
        host, sep, port_text = text.partition(":")
        port_text = port_text if sep else None
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"address {address!r}: the port must be a number in 0..65535, got {port_text!r}")
    return host, int(port_text)


#: the port a client dials when a target names none (blockd's default listen port)
DEFAULT_PORT = 50051


def dial_target(target: str, default_port: int = DEFAULT_PORT) -> str:
    """The one parse of an address a client dials: ``HOST[:PORT]`` ->
    ``HOST:PORT`` (no port: ``default_port``, never gRPC's 443). gRPC's own
    name forms (``dns:``, ``unix:``, ``ipv4:``, ``ipv6:``) pass as they are.
    ``ValueError`` naming what is wrong for a URL (``http://...``), an empty
    host or a port outside 1..65535 (gRPC would wrap 99999 to another port)."""
    text = target.strip()
    if text.startswith(("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:")):
        return text
    if "://" in text or "/" in text:
        raise ValueError(f"target {target!r} is not HOST:PORT (a blockd address is not a URL: drop the "
                         "scheme and the path)")
    host, port = split(text)
    if not host or host.isspace():
        raise ValueError(f"target {target!r} names no host; give HOST:PORT")
    if port is None:
        port = default_port
    if not 1 <= port <= 65535:
        raise ValueError(f"target {target!r}: the port must be in 1..65535")
    return join(host, port)


def split_listen(address: str) -> tuple[str, int]:
    """A listen address, ``HOST:PORT`` (port 0: any free one) -> ``(host, port)``;
    ``ValueError`` when it has no port."""
    host, port = split(address)
    if port is None:
        raise ValueError(f"listen address must be HOST:PORT, got {address!r}")
    return host, port


def join(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised(advertise: str | None, bound: str) -> str:
    """The address to hand out: ``advertise`` (its port taken from ``bound``
    when it gives none), or ``bound`` when ``advertise`` is empty."""
    if not advertise:
        return bound
    host, port = split(advertise)
    if port is None:
        _, port = split(bound)
        if port is None:
            raise ValueError(f"bound address {bound!r} has no port")
    return join(host, port)


def unroutable_reason(address: str) -> str | None:
    """Why another host could not dial ``address``, or None if it could."""
    try:
        host, port = split(address)
    except ValueError as err:
        return str(err)
    if host in WILDCARD_HOSTS:
        shown = host or "an empty host"
        return f"{shown} is not an address another host can dial (it means every interface of the server)"
    if port is None:
        return "it has no port (HOST:PORT)"
    if port == 0:
        return "port 0 is not a port anyone listens on"
    return None


__all__ = ["WILDCARD_HOSTS", "advertised", "join", "split", "split_listen", "unroutable_reason"]
