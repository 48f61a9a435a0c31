"""What one DRA driver offers the kubelet: its DRA service socket and its registration socket.

The DRA socket (`<plugins-dir>/<driver>/dra.sock`) serves DRA v1, v1beta1 and the health stream; it listens
before the registration socket (`<registry-dir>/<driver>-reg.sock`) appears, so the kubelet never dials a
socket that is not there yet. With a pod UID (two instances during a DaemonSet rolling update) both socket
names carry it, and the instances share the checkpoint under a file lock.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from agent.claims.preparer import Preparer
from agent.claims.results import ClaimResult
from agent.kubelet.grpc_server import MAX_SOCKET_PATH, UnixServer
from agent.kubelet.services import (
    DRA_PLUGIN_TYPE,
    SUPPORTED_VERSIONS,
    DraVersion,
    HealthSource,
    PluginInfo,
    add_dra_services,
    add_registration_service,
)
from backends.contract import ClaimRef

__all__ = ["KubeletPlugin", "socket_paths"]


def socket_paths(driver: str, plugins_dir: Path, registry_dir: Path, pod_uid: str | None) -> tuple[Path, Path]:
    """(DRA socket, registration socket) for a driver, unique per instance when a pod UID is given."""
    if pod_uid is None:
        return plugins_dir / driver / "dra.sock", registry_dir / f"{driver}-reg.sock"
    dra = plugins_dir / driver / f"dra-{pod_uid}.sock"
    registration = registry_dir / f"{driver}-{pod_uid}-reg.sock"
    if len(os.fsencode(registration)) > MAX_SOCKET_PATH:
        # Too long for a unix socket: a digest keeps it unique per driver and instance.
        digest = base64.urlsafe_b64encode(hashlib.sha256(f"{driver}\0{pod_uid}".encode()).digest()[:12]).decode()
        registration = registry_dir / f"dra-{digest}-reg.sock"
    return dra, registration


class KubeletPlugin:
    """The kubelet-facing side of one driver; delegates prepare and unprepare to its Preparer."""

    def __init__(
        self,
        *,
        driver: str,
        plugins_dir: Path,
        registry_dir: Path,
        pod_uid: str | None,
        preparer: Preparer,
        health: HealthSource,
        log: FilteringBoundLogger,
    ) -> None:
        self.driver = driver
        self.dra_socket, self.registration_socket = socket_paths(driver, plugins_dir, registry_dir, pod_uid)
        self.preparer = preparer
        self.registered = asyncio.Event()
        self._log = log.bind(driver=driver)
        info = PluginInfo(DRA_PLUGIN_TYPE, driver, str(self.dra_socket.absolute()), SUPPORTED_VERSIONS)
        self._dra = UnixServer(self.dra_socket, lambda s: add_dra_services(s, self, health, self._health_stream))
        self._registration = UnixServer(self.registration_socket, lambda s: add_registration_service(s, info, self))

    async def start(self) -> None:
        await self._dra.start()
        await self._registration.start()
        self._log.info("serving the kubelet", dra_socket=str(self.dra_socket),
                       registration_socket=str(self.registration_socket))

    async def stop(self, grace: float) -> None:
        """Let in-flight calls finish (new ones are refused), then deregister.

        In this order because deregistering makes the kubelet close its connection, which would cancel
        the calls in flight.
        """
        await self._dra.stop(grace)
        await self._registration.stop(0)

    async def prepare(self, claims: Sequence[ClaimRef], api_version: DraVersion = "v1") -> Mapping[str, ClaimResult]:
        return await self.preparer.prepare(claims, kubelet_api=api_version)

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return await self.preparer.unprepare(claims)

    def _health_stream(self, service: str) -> None:
        self._log.info("the kubelet opened a health stream", service=service)

    def registration_status(self, registered: bool, error: str) -> None:
        if registered:
            self._log.info("registered with the kubelet")
            self.registered.set()
        else:
            self._log.error("the kubelet refused the registration", error=error)
            self.registered.clear()

