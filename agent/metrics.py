"""Prometheus metrics and the HTTP endpoint that serves them with liveness and readiness probes.

`/metrics` (Prometheus text format), `/healthz` (the event loop answers), `/readyz` (start-up is done: every
driver's sockets are up and its slices are published, whether the kubelet has registered them is up to it; and
no backend reports hardware it cannot serve). /readyz answers 503 with one line per reason it is not ready.

Besides the agent's own metrics, the registry holds the process's (`process_resident_memory_bytes`,
`process_cpu_seconds_total`, `process_open_fds`, ...) and `python_info`. Counters and histograms carry no
`_created` series (see `Metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["DeviceHealth", "Metrics", "MetricsServer"]

_HEALTH_STATES = ("Healthy", "Unhealthy", "Unknown")
_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 45)


class Metrics:
    """The agent's metrics, in a registry of their own (several agents can live in one test process)."""

    def __init__(self) -> None:
        # A `_created` series (when the child was made) would double every counter's and histogram's series, one
        # more per label set, for a value Prometheus does not use in queries and that a restart shows anyway
        # (process_start_time_seconds). The switch is the library's and applies to the whole process, which
        # serves this one registry.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # the library leaves it unannotated
        self.registry = CollectorRegistry()
        # Read on each scrape from /proc/self: memory against the container's limit, CPU, open file descriptors.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.requests = Counter("dra_agent_node_requests", "Claims in kubelet prepare/unprepare calls",
                                ["driver", "operation", "outcome"], registry=self.registry)
        self.latency = Histogram("dra_agent_node_request_seconds", "Time to prepare or unprepare one claim",
                                 ["driver", "operation"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prepared_claims = Gauge("dra_agent_prepared_claims", "Claims prepared on this node",
                                     ["driver"], registry=self.registry)
        self.published_devices = Gauge("dra_agent_published_devices", "Devices in this node's ResourceSlices",
                                       ["driver"], registry=self.registry)
        self.api_errors = Counter("dra_agent_api_errors", "Failed requests to the Kubernetes API server",
                                  ["operation"], registry=self.registry)
        self.published_slices = Gauge("dra_agent_published_slices", "This node's ResourceSlices", ["driver"],
                                      registry=self.registry)
        self.device_health = DeviceHealth()
        self.registry.register(self.device_health)
        self.health_changes = Counter("dra_agent_device_health_changes", "Device health changes, by the new "
                                      "health and its cause", ["driver", "health", "cause"], registry=self.registry)
        self.reaped_claims = Counter("dra_agent_reaped_claims", "Prepared claims unprepared because their "
                                     "ResourceClaim was gone, replaced or no longer allocated to this node",
                                     ["driver", "reason"], registry=self.registry)
        self.claim_status_writes = Counter("dra_agent_claim_status_writes", "Server-side applies of a claim's "
                                           "status.devices, by outcome: ok, error (tried again), gone (the claim was "
                                           "deleted or replaced), refused (the server rejected it), gave-up",
                                           ["driver", "outcome"], registry=self.registry)
        self.events = Counter("dra_agent_events", "Events the agent reported (each occurrence, repeats of a series "
                              "included), by type and reason", ["type", "reason"], registry=self.registry)
        self.events_dropped = Counter("dra_agent_events_dropped", "Events never written to the API server, by cause: "
                                      "queue-full, refused, gave-up (retries exhausted), stopped, error, "
                                      "invalid-claim (about a claim whose reference is not a valid claim's)",
                                      ["cause"], registry=self.registry)
        self.events_pending = Gauge("dra_agent_events_pending", "Events waiting to be written to the API server",
                                    registry=self.registry)
        self.stream_clients = Gauge("dra_agent_health_stream_clients", "Open kubelet health streams", ["driver"],
                                    registry=self.registry)
        self.unserved_devices = Gauge("dra_agent_unserved_devices", "Devices a backend knows are on the node but "
                                      "cannot serve (e.g. NVIDIA GPUs without a usable NVML); see the agent's error "
                                      "log and /readyz for why", ["driver", "backend"], registry=self.registry)

    def set_health(self, driver: str, device: str, health: str) -> None:
        self.device_health.health[driver, device] = health

    def forget_device(self, driver: str, device: str) -> None:
        self.device_health.health.pop((driver, device), None)

    def observe(self, driver: str, operation: str, seconds: float, error: bool) -> None:
        self.requests.labels(driver, operation, "error" if error else "ok").inc()
        self.latency.labels(driver, operation).observe(seconds)


class DeviceHealth:
    """`dra_agent_device_health`: for each device, 1 for its current health and 0 for the other two, made from a
    dict when scraped. A labelled Gauge would keep three children per device, each with its lock and value, made
    at start-up for every device (10-25 ms for a node's 520 devices), where a scrape reads them now and then."""

    NAME = "dra_agent_device_health"
    HELP = "1 for the device's current health (Healthy, Unhealthy or Unknown), 0 for the others"

    def __init__(self) -> None:
        self.health: dict[tuple[str, str], str] = {}  # (driver, device) → Healthy, Unhealthy or Unknown

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> list[GaugeMetricFamily]:
        family = self._family()
        for (driver, device), health in list(self.health.items()):  # a copy: a scrape may come from a thread
            for state in _HEALTH_STATES:
                family.add_metric([driver, device, state], 1.0 if state == health else 0.0)
        return [family]

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.NAME, self.HELP, labels=["driver", "device", "health"])


class MetricsServer:
    """Serves the metrics and probes on host:port."""

    def __init__(self, address: str, metrics: Metrics, not_ready: Callable[[], Sequence[str]]) -> None:
        """`not_ready` says why the agent is not ready, one reason per item; nothing when it is."""
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"metrics address {address!r} must be HOST:PORT")
        self.host, self.port = host or "0.0.0.0", int(port)
        self._metrics = metrics
        self._not_ready = not_ready
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        # aiohttp's server half (~30 ms of imports) is loaded only where metrics are served, and then once the
        # drivers are started, not before them.
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/healthz", self._serve_health)
        app.router.add_get("/readyz", self._serve_ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]  # the real port when 0 asked for any

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(body=generate_latest(self._metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _serve_health(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.Response(text="ok\n")

    async def _serve_ready(self, request: web.Request) -> web.Response:
        from aiohttp import web

        reasons = self._not_ready()
        if not reasons:
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready:\n" + "".join(f"- {reason}\n" for reason in reasons))
