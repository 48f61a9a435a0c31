"""The CDI side of a prepared claim: one transient spec per claim and driver, one CDI device per device.

Pure. Vendor `k8s.<driver>`, class `claim`, device names `<claim UID>-<device>`, so the fully-qualified ID the
kubelet hands to the runtime is `k8s.<driver>/claim=<uid>-<device>`. Edits shared by the claim's devices
(control nodes, libraries, claim-wide environment) go to the spec's top level, applied once per container.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.claims.records import DeviceRecord
from cdi.spec import Device, Spec, merged

__all__ = ["CLASS", "cdi_device_id", "claim_spec", "vendor"]

CLASS = "claim"


def vendor(driver: str) -> str:
    return f"k8s.{driver}"


def cdi_device_id(driver: str, claim_uid: str, device: str) -> str:
    """The fully-qualified CDI ID of one device of a claim."""
    return f"{vendor(driver)}/{CLASS}={claim_uid}-{device}"


def claim_spec(driver: str, claim_uid: str, devices: Sequence[DeviceRecord]) -> Spec:
    """The claim's spec from its prepared devices."""
    return Spec(
        kind=f"{vendor(driver)}/{CLASS}",
        devices=tuple(Device(name=f"{claim_uid}-{r.device}", container_edits=r.edits) for r in devices),
        container_edits=merged([r.common_edits for r in devices if r.common_edits is not None]),
    )
