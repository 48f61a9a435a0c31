"""The test API server's HTTP side: routing of the real REST paths, bearer-token auth, fault rules, the request
log, JSON answers and ``Status`` errors, and watch streams (newline-delimited JSON events).

Patches: ``application/merge-patch+json`` is applied as RFC 7386; ``application/strategic-merge-patch+json``
is applied the same way, which is what strategic merge does for the atomic lists of ResourceSlices;
server-side apply (``application/apply-patch+yaml``) is served on ``resourceclaims/<name>/status`` for
``status.devices`` (simulator/apiserver/apply.py); JSON patch and server-side apply elsewhere are refused with 415.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from aiohttp import web

from simulator.apiserver.apply import APPLY_PATCH
from simulator.apiserver.faults import FaultRules, RequestRecord
from simulator.apiserver.resources import (
    VERSION_INFO,
    ApiError,
    JsonObject,
    ResourceType,
    discovery,
    resource_at,
)
from simulator.apiserver.selectors import Selector
from simulator.apiserver.store import Store
from simulator.apiserver.watches import BOOKMARK, Watch

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/version", "/healthz", "/livez", "/readyz"})
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_MERGE_TYPES = frozenset({"application/merge-patch+json", "application/strategic-merge-patch+json"})


def _flag(value: str | None) -> bool:
    return value in _TRUE


def json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    body = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def error_response(error: ApiError) -> web.Response:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return json_response(error.status(), error.code, headers)


@dataclass(frozen=True)
class Target:
    """What a resource path names: a type, a namespace (None: cluster-wide), an object and a subresource."""

    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def store_namespace(self) -> str:
        return self.namespace or ""


def route(path: str) -> Target:
    """Parse ``/api/v1/...`` and ``/apis/<group>/<version>/...`` paths; anything else is 404."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) >= 3:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[0] == "apis" and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise ApiError(404)
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    rt = resource_at(group, version, rest[0]) if 1 <= len(rest) <= 3 else None
    if rt is None or (namespace is not None and not rt.namespaced) or not all(rest):
        raise ApiError(404)
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if (sub is not None and (sub != "status" or not rt.has_status)) or (rt.namespaced and name and not namespace):
        raise ApiError(404)
    return Target(rt, namespace, name, sub)


class HttpFrontEnd:
    """One catch-all aiohttp handler in front of a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        faults: FaultRules,
        records: list[RequestRecord],
        *,
        token: str,
        address: Callable[[], str],
        bookmark_interval: float,
        watch_timeout: float,
    ) -> None:
        self.store = store
        self.faults = faults
        self.records = records
        self.token = token
        self.address = address
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout

    def application(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        record = RequestRecord(request.method, request.path, dict(request.query), time.monotonic(),
                               raw_path=request.rel_url.raw_path)
        self.records.append(record)
        try:
            response = await self._serve(request, record)
        except ApiError as error:
            response = error_response(error)
        except ConnectionError:
            raise  # the client went away; aiohttp closes the connection
        except Exception as error:  # a defect here: answer as the real server answers a panic, and say why
            log.exception("test API server failed on %s %s", request.method, request.path_qs)
            response = error_response(ApiError(500, f"Internal error occurred: {error!r}"))
        finally:
            record.duration = time.monotonic() - record.time
        record.status = record.status or response.status
        return response

    async def _serve(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"  # the real server serves /version/ and /apis/ too
        if path not in PUBLIC_PATHS and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401)
        delay, fault = self.faults.take(request.method, path, record.query)
        if delay:
            record.tags.add("delayed")
            await asyncio.sleep(delay)
        if fault is not None and fault.status is not None:
            record.tags.add("fault")
            raise ApiError(fault.status, fault.message, retry_after=fault.retry_after)
        if path == "/version":
            return json_response(VERSION_INFO)
        if path in PUBLIC_PATHS:
            return web.Response(text="ok")
        document = discovery(path, self.address())
        if document is not None:
            if request.method != "GET":
                raise ApiError(405)
            return json_response(document)
        target = route(path)
        query = record.query
        dry_run = query.get("dryRun") == "All"
        if target.name is None:
            return await self._collection(request, record, target, dry_run)
        return await self._item(request, target, dry_run)

    async def _collection(
        self, request: web.Request, record: RequestRecord, target: Target, dry_run: bool
    ) -> web.StreamResponse:
        rt, query = target.rt, record.query
        namespaced_path = target.namespace is not None or not rt.namespaced
        if request.method == "GET":
            selector = Selector.parse(rt, target.namespace, query)
            if _flag(query.get("watch")):
                record.tags.add("watch")
                return await self._watch(request, record, selector)
            limit = query.get("limit", "0")
            if not limit.isdigit():
                raise ApiError(400, f"limit: Invalid value: {limit!r}: must be a non-negative integer")
            return json_response(self.store.list(selector, limit=int(limit), continue_token=query.get("continue", "")))
        if request.method == "POST" and namespaced_path:
            body = await _body(request, frozenset({"application/json"}))
            return json_response(self.store.create(rt, target.store_namespace, body, dry_run=dry_run), 201)
        if request.method == "DELETE" and namespaced_path:
            selector = Selector.parse(rt, target.namespace, query)
            return json_response(self.store.delete_collection(selector, dry_run=dry_run))
        raise ApiError(405)

    async def _item(self, request: web.Request, target: Target, dry_run: bool) -> web.StreamResponse:
        rt, namespace, name = target.rt, target.store_namespace, target.name
        assert name is not None
        status = target.subresource == "status"
        if request.method == "GET":
            return json_response(self.store.get(rt, namespace, name))
        if request.method == "PUT":
            body = await _body(request, frozenset({"application/json"}))
            return json_response(self.store.update(rt, namespace, name, body, status=status, dry_run=dry_run))
        if request.method == "PATCH" and request.content_type == APPLY_PATCH and status and rt.has_status:
            body = await _body(request, frozenset({APPLY_PATCH}))
            query = request.query
            return json_response(self.store.apply_status(rt, namespace, name, body, query.get("fieldManager", ""),
                                                         force=_flag(query.get("force")), dry_run=dry_run))
        if request.method == "PATCH":
            patch = await _body(request, _MERGE_TYPES)
            return json_response(self.store.patch(rt, namespace, name, patch, status=status, dry_run=dry_run))
        if request.method == "DELETE" and not status:
            options = await _body(request, frozenset({"application/json"}), optional=True)
            deleted = self.store.delete(rt, namespace, name, options, dry_run=dry_run)
            if rt.returns_deleted:
                return json_response(deleted)
            details = {"name": name, "kind": rt.plural, "uid": deleted["metadata"]["uid"]}
            if rt.group:
                details["group"] = rt.group
            return json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "details": details})  # fmt: skip
        raise ApiError(405)

    async def _watch(self, request: web.Request, record: RequestRecord, selector: Selector) -> web.StreamResponse:
        query = record.query
        timeout_text = query.get("timeoutSeconds") or ""
        if timeout_text and not timeout_text.isdigit():
            raise ApiError(400, f"timeoutSeconds: Invalid value: {timeout_text!r}: must be a non-negative integer")
        timeout = float(timeout_text) if timeout_text else self.watch_timeout
        bookmarks = _flag(query.get("allowWatchBookmarks"))
        initial = _flag(query["sendInitialEvents"]) if "sendInitialEvents" in query else None
        watch = self.store.watch(selector, query.get("resourceVersion", ""), initial=initial, bookmarks=bookmarks)
        try:
            response = web.StreamResponse(headers={"Cache-Control": "no-cache, private"})
            response.content_type = "application/json"
            response.enable_chunked_encoding()
            await response.prepare(request)
            record.status = 200
            await self._stream(request, response, watch, timeout)
            return response
        finally:
            self.store.unwatch(watch)

    async def _stream(self, request: web.Request, response: web.StreamResponse, watch: Watch, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + self.bookmark_interval
        while (now := loop.time()) < deadline:
            item: JsonObject | str
            if not watch.queue.empty():
                item = watch.queue.get_nowait()
            elif watch.bookmarks and now >= next_bookmark:
                # Nothing is queued, so no event at or below this resourceVersion is still to come.
                item = {"type": BOOKMARK, "object": self.store.bookmark(watch.selector.rt)}
                next_bookmark = now + self.bookmark_interval
            else:
                wait = min(deadline, next_bookmark) - now if watch.bookmarks else deadline - now
                try:
                    item = await asyncio.wait_for(watch.queue.get(), wait)
                except TimeoutError:
                    continue
            if item == Watch.END:
                break
            if item == Watch.RESET:
                if request.transport is not None:
                    request.transport.abort()
                return
            assert isinstance(item, dict)
            try:
                await response.write(json.dumps(item, separators=(",", ":")).encode() + b"\n")
            except ConnectionError:
                return  # the client went away
        await response.write_eof()


async def _body(request: web.Request, accepted: frozenset[str], *, optional: bool = False) -> Any:
    raw = await request.read()
    if optional and not raw.strip():
        return None
    if request.content_type not in accepted:
        raise ApiError(415, "the body of the request was in an unknown format - accepted media types include: "
                       + ", ".join(sorted(accepted)))  # fmt: skip
    try:
        return json.loads(raw)
    except ValueError as error:
        if request.content_type == APPLY_PATCH:  # YAML, of which JSON is a part
            try:
                return yaml.safe_load(raw)
            except yaml.YAMLError:
                pass
        raise ApiError(400, f"couldn't get version/kind; json parse error: {error}") from None
