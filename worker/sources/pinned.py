"""Connections of declared HTTP tools go only to addresses that were checked.

A check that resolves the host and a client that resolves it again to connect can be
told two different things: a name with TTL 0 answers a public address to the check and
169.254.169.254 to the connect (DNS rebinding). Here the host is resolved once per
connection, inside the HTTP client's own connect step: every address of the answer is
checked, the socket is opened to one of them, and the peer it reached is checked again.
httpx and httpcore still see the host name, so the Host header, SNI and the certificate
check use it.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, NamedTuple

import httpcore
import httpx

# Cloud metadata endpoints outside the link-local ranges (Alibaba, AWS over IPv6) and AWS's own.
METADATA = {ipaddress.ip_address(a) for a in ("100.100.100.200", "fd00:ec2::254", "169.254.169.254")}

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Refused(Exception):
    """The request may not be sent (host, address or credentials)."""


class Target(NamedTuple):
    """Where the next request may connect: the host as httpcore names it, its port, and
    whether the operator allows it to reach link-local and metadata addresses."""

    host: str
    port: int
    link_local_ok: bool


def target(url: str, link_local_ok: bool) -> Target:
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return Target(parsed.raw_host.decode("ascii"), port, link_local_ok)


def forbidden(address: Address) -> bool:
    return address.is_link_local or address in METADATA or address.is_unspecified


def resolve(host: str, port: int, link_local_ok: bool) -> list[tuple[Address, str]]:
    """One lookup: (address, what to connect to) for each address of the answer, or
    ``Refused`` when any of them is forbidden. A failed lookup fails the request."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpcore.ConnectError(f"{host}: cannot resolve ({exc})") from None
    found = {_address(info[4][0]): str(info[4][0]) for info in infos}
    bad = sorted(str(a) for a in found if forbidden(a))
    if bad and not link_local_ok:
        raise Refused(f"{host} resolves to {', '.join(bad)}: a link-local or metadata address; only "
                      "TOOLOOP_ALLOWED_API_BASES may name one")  # fmt: skip
    return list(found.items())


def _address(text: str) -> Address:
    address = ipaddress.ip_address(text.split("%")[0])  # a zone (fe80::1%eth0) is no part of it
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


class PinnedBackend(httpcore.SyncBackend):
    """httpcore's own sockets, opened to checked addresses of the current ``target`` only."""

    def __init__(self) -> None:
        self.target: Target | None = None

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None) -> Any:  # fmt: skip
        wanted = self.target
        if wanted is None or (host, port) != (wanted.host, wanted.port):
            raise Refused(f"{host}:{port} is not the request's checked target")
        addresses = resolve(host, port, wanted.link_local_ok)
        error: Exception = httpcore.ConnectError(f"{host}: no address")
        for address, dial in addresses:
            try:
                stream = super().connect_tcp(dial, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:  # the next address, as a resolving client would
                error = exc
                continue
            peer = _address(stream.get_extra_info("server_addr")[0])
            if peer != address:
                stream.close()
                raise Refused(f"{host}: the connection reached {peer}, not the checked {address}")
            return stream
        raise error


class PinnedTransport(httpx.HTTPTransport):
    """httpx's transport over a ``PinnedBackend``. httpx takes no network backend
    (encode/httpx#3749), so the pool it built is replaced by the same pool with ours."""

    def __init__(self, backend: PinnedBackend) -> None:
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                             network_backend=backend)  # fmt: skip
