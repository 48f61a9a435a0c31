"""What preparing a claim answers: its devices as the kubelet receives them (pool, device, CDI ids, requests,
share id), or a non-empty error. The kubelet's gRPC service (agent/kubelet/services.py) turns these into protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClaimResult", "PreparedDeviceResult"]


@dataclass(frozen=True)
class PreparedDeviceResult:
    """One device of a prepared claim, as the kubelet receives it."""

    pool: str
    device: str
    cdi_device_ids: tuple[str, ...] = ()
    request_names: tuple[str, ...] = ()
    share_id: str | None = None


@dataclass(frozen=True)
class ClaimResult:
    """The answer for one claim: its devices, or a non-empty error."""

    devices: tuple[PreparedDeviceResult, ...] = ()
    error: str = ""
