"""A Kubernetes API server double for tests, benchmarks and the demo: the real REST paths and JSON of the
resources the agent uses (nodes, events, and resource.k8s.io/v1 ResourceSlices, ResourceClaims and
DeviceClasses), served over plain HTTP on loopback, so the official client works against it unchanged.

``TestApiServer`` owns the listening socket and the lifecycle, and offers tests direct access to the stored
objects, fault injection and the request log. Run ``python -m simulator.apiserver.server --port N --kubeconfig
PATH`` to serve it standalone until SIGINT or SIGTERM.

Left out on purpose: namespaces as objects (any namespace exists), finalizers and graceful deletion,
authorization (but for the per-driver check of a claim's ``status.devices`` writes,
simulator/apiserver/authorization.py), admission, feature-gated field dropping, Warning headers, managedFields
and server-side apply (but for a ResourceClaim's status.devices, simulator/apiserver/apply.py), JSON patch and
strategic-merge directives, ``fieldValidation``, validation of other kinds than ResourceSlice and
events.k8s.io/v1 Event beyond their names (but a DeviceClass's extendedResourceName), the time to live of Events,
consistent snapshots behind list ``continue`` tokens and ``resourceVersion`` reads, closing watches that fall
behind, conversion between the core/v1 and events.k8s.io/v1 Event APIs, and aggregated discovery.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import yaml
from aiohttp import web

from simulator.apiserver.authorization import ANYONE, Caller
from simulator.apiserver.faults import Fault, FaultRules, Methods, PathPattern, QueryTest, RequestRecord
from simulator.apiserver.faults import select_records as _select
from simulator.apiserver.http import HttpFrontEnd
from simulator.apiserver.objects import json_copy
from simulator.apiserver.resources import (
    EVENTS,
    EVENTS_V1,
    NODES,
    RESOURCE_CLAIMS,
    ApiError,
    JsonObject,
    resource_named,
)
from simulator.apiserver.store import Store

__all__ = ["Caller", "Fault", "RequestRecord", "TestApiServer", "main"]

DEFAULT_TOKEN = "test-token"  # a fixed token: the server only listens on loopback


class TestApiServer:
    """A Kubernetes API server on 127.0.0.1 (an ephemeral port unless ``port`` is given).

    ``history_size`` bounds the change history that watches replay from (older resourceVersions get 410);
    ``bookmark_interval`` is how often watches that allow bookmarks get one (the real server: about a
    minute); ``watch_timeout`` ends watches that give no ``timeoutSeconds``; ``caller`` is who the token stands
    for, and which drivers' entries of a claim's ``status.devices`` it may change (simulator/apiserver/
    authorization.py; by default every driver's).
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = DEFAULT_TOKEN,
        history_size: int = 10_000,
        bookmark_interval: float = 60.0,
        watch_timeout: float = 1800.0,
        disabled_gates: Iterable[str] = (),
        caller: Caller = ANYONE,
    ) -> None:
        self.host, self.token = host, token
        self.store = Store(history_size, disabled_gates, caller)
        self.faults = FaultRules()
        self.requests: list[RequestRecord] = []
        self._port = port
        self._front = HttpFrontEnd(
            self.store, self.faults, self.requests, token=token, address=lambda: f"{self.host}:{self._port}",
            bookmark_interval=bookmark_interval, watch_timeout=watch_timeout,
        )  # fmt: skip
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._resume: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # handler_cancellation: a watch whose client disconnects ends at once instead of at its timeout.
        self._runner = web.AppRunner(
            self._front.application(), handler_cancellation=True, access_log=None, shutdown_timeout=2.0
        )
        await self._runner.setup()
        await self.accept_connections()

    async def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        self.store.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self._site = None, None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR: listening again on the same port must work while old connections are in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Linux copies TCP_NODELAY from the listening socket to every accepted connection. Without it,
            # Nagle's algorithm and delayed ACKs hold small responses back ~40 ms, where Go's net/http (the
            # real server) never waits; asyncio and aiohttp set it per connection too.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self._port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        return sock

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def bookmark_interval(self) -> float:
        """Seconds between the BOOKMARKs of watches that allow them; takes effect for newly opened watches."""
        return self._front.bookmark_interval

    @bookmark_interval.setter
    def bookmark_interval(self, seconds: float) -> None:
        self._front.bookmark_interval = seconds

    @property
    def caller(self) -> Caller:
        """Who the token stands for; set it to change what the token may do from the next request on."""
        return self.store.caller

    @caller.setter
    def caller(self, caller: Caller) -> None:
        self.store.caller = caller

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers for raw HTTP requests: the bearer token every non-public path needs."""
        return {"Authorization": f"Bearer {self.token}"}

    def write_kubeconfig(self, path: str | os.PathLike[str], *, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server (plain http, a token user) to ``path`` and return the path."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test-apiserver", "cluster": {"server": self.url}}],
            "users": [{"name": "test-user", "user": {"token": self.token}}],
            "contexts": [
                {"name": "test", "context": {"cluster": "test-apiserver", "user": "test-user", "namespace": namespace}}
            ],
            "current-context": "test",
            "preferences": {},
        }
        target = Path(path)
        target.write_text(yaml.safe_dump(config, sort_keys=False))
        target.chmod(0o600)
        return target

    def connection_nodelay(self) -> list[bool]:
        """Whether TCP_NODELAY is set, for each open client connection."""
        server = self._runner.server if self._runner is not None else None
        states = []
        for handler in server.connections if server is not None else ():
            sock = handler.transport.get_extra_info("socket") if handler.transport is not None else None
            if sock is not None:
                states.append(bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
        return states

    # --- stored objects ------------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion."""
        return str(self.store.resource_version)

    def objects(self, kind: str) -> list[JsonObject]:
        """Copies of the stored objects of a type, by plural (``resourceslices``), ``plural.group`` or kind."""
        return self.store.objects(resource_named(kind))

    def count(self, kind: str) -> int:
        """How many objects of a type are stored (cheap enough to poll, unlike ``objects``)."""
        return self.store.count(resource_named(kind))

    def get_object(self, kind: str, name: str, namespace: str = "default") -> JsonObject | None:
        """A copy of one stored object, or None (``namespace`` is ignored for cluster-scoped kinds)."""
        rt = resource_named(kind)
        try:
            return json_copy(self.store.get(rt, namespace if rt.namespaced else "", name))
        except ApiError:
            return None

    def put_object(self, kind: str, obj: JsonObject) -> JsonObject:
        """Create or replace ``obj`` as given, status included and without validation; watchers see it."""
        return self.store.put(resource_named(kind), obj)

    def put_claim(self, obj: JsonObject) -> JsonObject:
        """Store a ResourceClaim as given, e.g. with ``status.allocation`` already set (namespace: default)."""
        return self.store.put(RESOURCE_CLAIMS, obj)

    def add_node(self, name: str, *, labels: dict[str, str] | None = None) -> str:
        """Register a Node and return its uid."""
        node = {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
        return str(self.store.put(NODES, node)["metadata"]["uid"])

    def delete_object(self, kind: str, name: str, namespace: str = "default") -> bool:
        """Delete an object now (watchers get DELETED); False if there was none."""
        return self.store.remove(resource_named(kind), namespace, name)

    def events(self) -> list[JsonObject]:
        """Every recorded Event: those created through core/v1, then those through events.k8s.io/v1."""
        return self.store.objects(EVENTS) + self.store.objects(EVENTS_V1)

    def compact(self) -> None:
        """Forget the change history: watches from any older resourceVersion now get 410 Gone."""
        self.store.compact()

    def send_bookmarks(self) -> int:
        """Send a BOOKMARK now on every open watch that allows them; returns how many."""
        return self.store.send_bookmarks()

    # --- faults --------------------------------------------------------------------------------

    def fail(
        self,
        method: Methods,
        path: PathPattern,
        status: int = 500,
        *,
        times: int | None = 1,
        retry_after: int | None = None,
        message: str | None = None,
        query: QueryTest | None = None,
    ) -> Fault:
        """Answer the next ``times`` matching requests (None: all, until cleared) with ``status`` and a real
        ``Status`` body; ``retry_after`` adds the Retry-After header (and ``details.retryAfterSeconds``), which
        a 429 always carries, 1 s unless given, as from the real server's priority and fairness.

        ``method`` is a method, several, or None/"*" for any; ``path`` a glob (``*`` crosses ``/``) or a
        compiled regex matched against the whole path; ``query`` a predicate on the query parameters."""
        if status == 429 and retry_after is None:
            retry_after = 1
        return self.faults.add(Fault(method, path, status, times=times, query=query, retry_after=retry_after,
                                     message=message))  # fmt: skip

    def delay(
        self, method: Methods, path: PathPattern, seconds: float, *, times: int | None = None,
        query: QueryTest | None = None,
    ) -> Fault:  # fmt: skip
        """Hold matching requests ``seconds`` before serving them (the next ``times``; None: all)."""
        return self.faults.add(Fault(method, path, delay=seconds, times=times, query=query))

    def clear_faults(self) -> None:
        self.faults.clear()

    def drop_watches(self, *, reset: bool = False) -> int:
        """End every open watch now: a clean end of stream, or with ``reset`` a dropped connection."""
        return self.store.end_watches(reset=reset)

    async def refuse_connections(self, seconds: float | None = None) -> None:
        """Stop listening and drop every open connection, so clients get "connection refused"; after
        ``seconds`` (if given) listen again on the same port. :meth:`accept_connections` ends it early."""
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()
        self.store.end_watches(reset=True)
        server = self._runner.server if self._runner is not None else None
        for handler in server.connections if server is not None else ():
            if handler.transport is not None:
                handler.transport.abort()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if seconds is not None:
            self._resume = asyncio.create_task(self._accept_after(seconds))

    async def _accept_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self._resume = None
        await self.accept_connections()

    async def accept_connections(self) -> None:
        """Listen (again) on the server's port."""
        if self._resume is not None and self._resume is not asyncio.current_task():
            self._resume.cancel()
            self._resume = None
        if self._site is None and self._runner is not None:
            self._site = web.SockSite(self._runner, self._listen())
            await self._site.start()

    @property
    def listening(self) -> bool:
        return self._site is not None

    # --- request log ---------------------------------------------------------------------------

    def find_requests(
        self, method: Methods = None, path: PathPattern = "*", *, since: float | None = None,
        until: float | None = None, status: int | None = None,
    ) -> list[RequestRecord]:  # fmt: skip
        """Logged requests by method(s), path pattern (as in :meth:`fail`), arrival window and status.

        Times are ``time.monotonic()`` values."""
        return _select(self.requests, method, path, since=since, until=until, status=status)

    def count_requests(
        self, method: Methods = None, path: PathPattern = "*", *, since: float | None = None,
        until: float | None = None, status: int | None = None,
    ) -> int:  # fmt: skip
        """How many logged requests :meth:`find_requests` would return."""
        return len(self.find_requests(method, path, since=since, until=until, status=status))

    def writes(self, kind: str = "resourceslices", *, since: float | None = None, until: float | None = None) -> int:
        """Create, update, patch and delete requests to a type (any namespace) in the window [since, until)."""
        rt = resource_named(kind)
        pattern = rf"{re.escape(rt.prefix)}(/namespaces/[^/]+)?/{rt.plural}(/.*)?"
        return self.count_requests(("POST", "PUT", "PATCH", "DELETE"), re.compile(pattern), since=since, until=until)

    def clear_requests(self) -> None:
        self.requests.clear()


# --- standalone ------------------------------------------------------------------------------------


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with TestApiServer(host=args.host, port=args.port, token=args.token,
                             bookmark_interval=args.bookmark_interval) as server:  # fmt: skip
        for node in args.node:
            server.add_node(node)
        if args.kubeconfig:
            server.write_kubeconfig(args.kubeconfig)
        print(server.url, flush=True)  # the last thing before serving, so a parent can wait for this line
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.apiserver.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 (the default) picks a free port")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for the server here")
    parser.add_argument("--token", default=DEFAULT_TOKEN, help="the bearer token clients must send")
    parser.add_argument("--node", action="append", default=[], help="register a Node (repeatable)")
    parser.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds between watch bookmarks")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
