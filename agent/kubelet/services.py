"""The kubelet's gRPC APIs in the agent's own terms: the only module that imports the generated protobuf code.

Server side: servicers for plugin registration, DRA `v1.DRAPlugin` and `v1beta1.DRAPlugin` (same handler, two
wire packages), `v1.DRAResourceHealth` and `v1alpha1.DRAResourceHealth` (same source, two wire packages). Client
side (used by the kubelet simulator): the calls the kubelet makes. Both sides convert between protobuf messages
and the frozen dataclasses below.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

import grpc

from agent.claims.results import ClaimResult, PreparedDeviceResult
from agent.kubelet._proto import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from backends.contract import ClaimRef

__all__ = [
    "DRA_PLUGIN_TYPE",
    "HEALTH_SERVICES",
    "SUPPORTED_VERSIONS",
    "DeviceHealthReport",
    "DraClient",
    "DraHandler",
    "DraVersion",
    "HealthSource",
    "HealthStatus",
    "PluginInfo",
    "RegistrationClient",
    "RegistrationListener",
    "add_dra_services",
    "add_registration_service",
    "watch_health",
]

DRA_PLUGIN_TYPE = "DRAPlugin"
# Advertised in this order so a 1.34+ kubelet picks v1 and a 1.32/1.33 kubelet picks v1beta1. The health stream: a
# 1.37 kubelet prefers v1 when offered, older ones know only v1alpha1 (the kubelet chooses by its own order).
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")

HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
"""The health stream's services, in the order a 1.37 kubelet prefers them."""
_HEALTH: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1.DRAResourceHealth": (dra_health_v1_pb2, dra_health_v1_pb2_grpc),
    "v1alpha1.DRAResourceHealth": (dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc),
}

DraVersion = Literal["v1", "v1beta1"]
_DRA: dict[str, tuple[ModuleType, ModuleType]] = {
    "v1": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}


class HealthStatus(enum.IntEnum):
    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


@dataclass(frozen=True)
class DeviceHealthReport:
    """The health of one device in a NodeWatchResources message."""

    pool: str
    device: str
    health: HealthStatus
    last_updated: int = 0
    timeout_seconds: int = 0
    message: str = ""


@dataclass(frozen=True)
class PluginInfo:
    """What GetInfo answers."""

    type: str
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]


class DraHandler(Protocol):
    """What the DRA servicers delegate to; results are keyed by claim UID, one entry per claim asked. `api_version`:
    the DRA API version the kubelet called (`v1`, or `v1beta1` from a kubelet older than 1.34)."""

    async def prepare(self, claims: Sequence[ClaimRef], api_version: DraVersion = "v1") -> Mapping[str, ClaimResult]:
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]: ...


class HealthSource(Protocol):
    """Full device lists to stream, each one a complete report of the driver's devices."""

    def watch(self) -> AsyncIterator[Sequence[DeviceHealthReport]]: ...


class RegistrationListener(Protocol):
    def registration_status(self, registered: bool, error: str) -> None: ...


def _claims(request: Any) -> list[ClaimRef]:
    return [ClaimRef(uid=c.uid, namespace=c.namespace, name=c.name) for c in request.claims]


class _DraServicer:
    """NodePrepareResources / NodeUnprepareResources for one wire version."""

    def __init__(self, version: DraVersion, handler: DraHandler) -> None:
        self._pb = _DRA[version][0]
        self._version = version
        self._handler = handler

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        results = await self._handler.prepare(_claims(request), self._version)
        response = self._pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            entry.error = result.error
            for device in result.devices:
                message = entry.devices.add(
                    request_names=list(device.request_names),
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=list(device.cdi_device_ids),
                )
                if device.share_id is not None and self._version == "v1":
                    message.share_id = device.share_id
        return response

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        errors = await self._handler.unprepare(_claims(request))
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            response.claims[uid].error = error
        return response


class _HealthServicer:
    def __init__(self, source: HealthSource, pb: ModuleType, service: str,
                 on_stream: Callable[[str], None]) -> None:
        self._source = source
        self._pb = pb
        self._service = service
        self._on_stream = on_stream

    async def NodeWatchResources(
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        pb = self._pb
        self._on_stream(self._service)
        async for reports in self._source.watch():
            yield pb.NodeWatchResourcesResponse(devices=[
                pb.DeviceHealth(
                    device=pb.DeviceIdentifier(pool_name=r.pool, device_name=r.device),
                    health=r.health.name,
                    last_updated_time=r.last_updated,
                    health_check_timeout_seconds=r.timeout_seconds,
                    message=r.message,
                )
                for r in reports
            ])


class _RegistrationServicer:
    def __init__(self, info: PluginInfo, listener: RegistrationListener) -> None:
        self._info = info
        self._listener = listener

    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return pluginregistration_v1_pb2.PluginInfo(
            type=self._info.type,
            name=self._info.name,
            endpoint=self._info.endpoint,
            supported_versions=list(self._info.supported_versions),
        )

    async def NotifyRegistrationStatus(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self._listener.registration_status(request.plugin_registered, request.error)
        if not request.plugin_registered:
            # As the upstream helper does: a refused registration is answered with an error.
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed registration process: {request.error}")
        return pluginregistration_v1_pb2.RegistrationStatusResponse()


def add_dra_services(server: grpc.aio.Server, handler: DraHandler, health: HealthSource,
                     on_health_stream: Callable[[str], None] = lambda service: None) -> None:
    """Serve DRA v1 and v1beta1 and health v1 and v1alpha1 on one server (one socket); `on_health_stream` hears the
    service name ("v1.DRAResourceHealth") of each health stream the kubelet opens."""
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_DraServicer("v1", handler), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(_DraServicer("v1beta1", handler), server)
    for service, (pb, grpc_module) in _HEALTH.items():
        grpc_module.add_DRAResourceHealthServicer_to_server(
            _HealthServicer(health, pb, service, on_health_stream), server)


def add_registration_service(server: grpc.aio.Server, info: PluginInfo, listener: RegistrationListener) -> None:
    pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(info, listener), server)


# --- client side: what the kubelet calls -------------------------------------------------------------------


class RegistrationClient:
    """The kubelet's side of plugin registration."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)

    async def get_info(self, timeout: float = 1.0) -> PluginInfo:
        info = await self._stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=timeout)
        return PluginInfo(info.type, info.name, info.endpoint, tuple(info.supported_versions))

    async def notify(self, registered: bool, error: str = "", timeout: float = 5.0) -> None:
        status = pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=registered, error=error)
        await self._stub.NotifyRegistrationStatus(status, timeout=timeout)


class DraClient:
    """The kubelet's DRA calls in one wire version."""

    def __init__(self, channel: grpc.aio.Channel, version: DraVersion = "v1") -> None:
        self.version = version
        self._pb, grpc_module = _DRA[version]
        self._stub = grpc_module.DRAPluginStub(channel)

    def _request(self, kind: str, claims: Sequence[ClaimRef]) -> Any:
        message = getattr(self._pb, kind)
        return message(claims=[self._pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims])

    async def prepare(self, claims: Sequence[ClaimRef], timeout: float = 45.0) -> dict[str, ClaimResult]:
        response = await self._stub.NodePrepareResources(
            self._request("NodePrepareResourcesRequest", claims), timeout=timeout
        )
        return {
            uid: ClaimResult(
                devices=tuple(
                    PreparedDeviceResult(
                        pool=d.pool_name,
                        device=d.device_name,
                        cdi_device_ids=tuple(d.cdi_device_ids),
                        request_names=tuple(d.request_names),
                        share_id=d.share_id if self.version == "v1" and d.HasField("share_id") else None,
                    )
                    for d in entry.devices
                ),
                error=entry.error,
            )
            for uid, entry in response.claims.items()
        }

    async def unprepare(self, claims: Sequence[ClaimRef], timeout: float = 45.0) -> dict[str, str]:
        response = await self._stub.NodeUnprepareResources(
            self._request("NodeUnprepareResourcesRequest", claims), timeout=timeout
        )
        return {uid: entry.error for uid, entry in response.claims.items()}


async def watch_health(channel: grpc.aio.Channel, service: str = HEALTH_SERVICES[0]
                       ) -> AsyncGenerator[list[DeviceHealthReport], None]:
    """The kubelet's NodeWatchResources stream of health `service`: one full device list per message; closing it
    (`aclose`) ends the call."""
    pb, grpc_module = _HEALTH[service]
    stub = grpc_module.DRAResourceHealthStub(channel)
    call = stub.NodeWatchResources(pb.NodeWatchResourcesRequest())
    async for message in call:
        yield [
            DeviceHealthReport(
                pool=d.device.pool_name,
                device=d.device.device_name,
                health=HealthStatus(d.health),
                last_updated=d.last_updated_time,
                timeout_seconds=d.health_check_timeout_seconds,
                message=d.message,
            )
            for d in message.devices
        ]
