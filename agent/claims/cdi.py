"""The CDI side of a prepared claim: one transient spec per claim and driver, one CDI device per device.

Pure. Vendor `k8s.<driver>`, class `claim`, device names `<claim UID>-<device>`, and `<claim UID>-<device>-<share
ID>` for a share of a device (as the upstream example driver names them), so the fully-qualified ID the kubelet
hands to the runtime is `k8s.<driver>/claim=<uid>-<device>[-<share>]`. Edits shared by the claim's devices
(control nodes, libraries, claim-wide environment) go to the spec's top level, applied once per container.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.claims.records import DeviceRecord
from cdi.spec import Device, Spec, merged

__all__ = ["CLASS", "cdi_device_id", "claim_spec", "device_name", "vendor"]

CLASS = "claim"


def vendor(driver: str) -> str:
    return f"k8s.{driver}"


def device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    """The CDI device name of one device (or one share of it) of a claim."""
    return f"{claim_uid}-{device}" if share_id is None else f"{claim_uid}-{device}-{share_id}"


def cdi_device_id(driver: str, claim_uid: str, device: str, share_id: str | None = None) -> str:
    """The fully-qualified CDI ID of one device (or one share of it) of a claim."""
    return f"{vendor(driver)}/{CLASS}={device_name(claim_uid, device, share_id)}"


def claim_spec(driver: str, claim_uid: str, devices: Sequence[DeviceRecord]) -> Spec:
    """The claim's spec from its prepared devices."""
    return Spec(
        kind=f"{vendor(driver)}/{CLASS}",
        devices=tuple(Device(name=device_name(claim_uid, r.device, r.share_id), container_edits=r.edits)
                      for r in devices),
        container_edits=merged([r.common_edits for r in devices if r.common_edits is not None]),
    )
