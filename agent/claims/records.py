"""What the checkpoint records of a prepared claim and its devices, and their JSON form in the journal.

A record is enough to answer the kubelet again (request names, CDI device IDs) and to undo the preparation after a
restart (the backends' restore records), without the ResourceClaim, which may be gone by then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.attributes import AttributeValue, attribute_from_json, attribute_json
from backends.contract import NetworkData
from cdi.spec import ContainerEdits, edits_from_dict, edits_to_dict, shared_edits_dict

__all__ = ["ClaimRecord", "DeviceRecord", "State"]

State = Literal["started", "completed"]


@dataclass(frozen=True)
class DeviceRecord:
    """A device as prepared for a claim: enough to answer the kubelet again and to undo it after a restart.
    `admin_access`: allocated with adminAccess, so it does not hold the device against other claims.
    `share_id`: the claim holds this share of a device shared by capacity. `facts` and `network`: what the
    workload learns about the device (the claim's status and device metadata are written from them)."""

    device: str
    backend: str
    requests: tuple[str, ...] = ()
    cdi_ids: tuple[str, ...] = ()
    edits: ContainerEdits = field(default_factory=ContainerEdits)
    common_edits: ContainerEdits | None = None
    restore: Mapping[str, Any] = field(default_factory=dict)
    admin_access: bool = False
    share_id: str | None = None
    facts: Mapping[str, AttributeValue] = field(default_factory=dict)
    network: NetworkData | None = None

    def to_json(self, *, shared: bool = False) -> dict[str, Any]:
        """The record's JSON object; with `shared`, for serializing at once (edits are `shared_edits_dict`'s)."""
        edits = shared_edits_dict if shared else edits_to_dict
        data: dict[str, Any] = {
            "device": self.device,
            "backend": self.backend,
            "requests": list(self.requests),
            "cdiIds": list(self.cdi_ids),
            "edits": edits(self.edits),
            "commonEdits": None if self.common_edits is None else edits(self.common_edits),
            "restore": dict(self.restore),
        }
        if self.admin_access:
            data["adminAccess"] = True
        if self.share_id is not None:
            data["shareId"] = self.share_id
        if self.facts:
            data["facts"] = {key: attribute_json(value) for key, value in self.facts.items()}
        if self.network is not None:
            data["network"] = {"interfaceName": self.network.interface_name,
                               "hardwareAddress": self.network.hardware_address, "ips": list(self.network.ips)}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceRecord:
        common = data.get("commonEdits")
        share = data.get("shareId")
        network = data.get("network")
        return cls(
            device=_text(data, "device"),
            backend=_text(data, "backend"),
            requests=tuple(data.get("requests", ())),
            cdi_ids=tuple(data.get("cdiIds", ())),
            edits=edits_from_dict(data.get("edits") or {}),
            common_edits=None if common is None else edits_from_dict(common),
            restore=dict(data.get("restore") or {}),
            admin_access=data.get("adminAccess", False) is True,
            share_id=share if isinstance(share, str) else None,
            facts={key: attribute_from_json(value) for key, value in (data.get("facts") or {}).items()},
            network=None if not isinstance(network, Mapping) else NetworkData(
                interface_name=str(network.get("interfaceName", "")),
                hardware_address=str(network.get("hardwareAddress", "")),
                ips=tuple(str(ip) for ip in network.get("ips") or ()),
            ),
        )


@dataclass(frozen=True)
class ClaimRecord:
    """The state of one claim of this driver. `owner` is the agent instance that wrote the record (a `started`
    record is rolled back only once its owner is gone); `recovered` marks a claim known from its CDI spec alone
    (its journal records were lost), whose request names are not known until the kubelet asks again."""

    uid: str
    namespace: str
    name: str
    state: State
    boot_id: str
    devices: tuple[DeviceRecord, ...]  # for `started`, only device and backend are known
    owner: str = ""
    recovered: bool = False

    def to_json(self, *, shared: bool = False) -> dict[str, Any]:
        """The record's JSON object; with `shared`, for serializing at once (see DeviceRecord.to_json)."""
        data: dict[str, Any] = {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "state": self.state,
            "bootId": self.boot_id,
            "devices": [d.to_json(shared=shared) for d in self.devices],
        }
        if self.owner:
            data["owner"] = self.owner
        if self.recovered:
            data["recovered"] = True
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClaimRecord:
        state = data["state"]
        if state not in ("started", "completed"):
            raise ValueError(f"unknown claim state {state!r}")
        devices = data["devices"]
        if not isinstance(devices, list):
            raise TypeError("devices is not a list")
        return cls(
            uid=_text(data, "uid"),
            namespace=_text(data, "namespace"),
            name=_text(data, "name"),
            state=state,
            boot_id=_text(data, "bootId"),
            devices=tuple(DeviceRecord.from_json(d) for d in devices),
            owner=str(data.get("owner", "")),
            recovered=data.get("recovered", False) is True,
        )


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} is not a string")
    return value
