"""Why a request did not reach the API server, or got no whole answer, in words an operator reads: what the agent
tried and what happened, never the HTTP library's exception names or Python's errno texts. The message ends up
in the kubelet's answer for a claim, in Events and in the log."""

from __future__ import annotations

import errno
import ssl

import aiohttp

__all__ = ["why_unreachable"]

# What an operating system error means for a connection to the API server.
_ERRNO = {
    errno.ECONNREFUSED: "connection refused (nothing listens there)",
    errno.ECONNRESET: "the connection was reset",
    errno.EHOSTUNREACH: "no route to the host",
    errno.ENETUNREACH: "the network is unreachable",
    errno.ETIMEDOUT: "the connection timed out",
    errno.EPIPE: "the connection was closed",
    errno.EACCES: "permission denied",
    errno.EADDRNOTAVAIL: "no local address to connect from",
}


def why_unreachable(e: BaseException) -> str:
    """The cause of a failed request, for "<what was asked>: <cause>"."""
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return f"the API server's certificate is not trusted at {_where(e)}: {_tls(e.certificate_error)}"
    if isinstance(e, aiohttp.ClientConnectorDNSError):
        return f"the API server's host name {e.host} does not resolve"
    if isinstance(e, aiohttp.ClientConnectorSSLError):
        return f"no TLS connection to {_where(e)}: {_tls(e.os_error)}"
    if isinstance(e, aiohttp.ClientProxyConnectionError):
        return f"cannot connect to the proxy at {_where(e)}: {_os(e.os_error)}"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect to the API server at {_where(e)}: {_os(e.os_error)}"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the API server closed the connection before it answered"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "the API server's answer was cut short"
    if isinstance(e, aiohttp.ClientHttpProxyError):
        return f"the proxy refused the request (HTTP {e.status})"
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer from the API server in time"
    if isinstance(e, ValueError):  # a torn JSON line, an invalid URL
        return "the API server's answer cannot be read"
    if isinstance(e, OSError):
        return _os(e)
    return "the request could not be sent"


def _where(e: aiohttp.ClientConnectorError) -> str:
    return f"{e.host}:{e.port}"


def _os(e: OSError) -> str:
    if e.errno in _ERRNO:
        return _ERRNO[e.errno]
    return (e.strerror or "the connection failed").lower() if e.errno else "the connection failed"


def _tls(e: BaseException) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return e.verify_message or "certificate verify failed"
    if isinstance(e, ssl.SSLError):
        return (e.reason or "TLS handshake failed").lower().replace("_", " ")
    return "TLS handshake failed"
