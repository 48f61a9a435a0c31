"""`VfConfig`, the sriov-nic backend's claim configuration: hand the VF's network interface to the pod.

Pure. `netDevice: {name: net1}` asks for the VF's interface (its netdev) to be moved into the pod's network
namespace under that name; the agent writes it as a CDI `netDevices` edit and the container runtime moves it (see
`backends.sriov.vf_netdev`). The name is one the kernel takes (`cdi.interface_names`: 1 to 15 bytes, not `.` or `..`, no
`/`, `:`, NUL or byte the kernel counts as whitespace) and is not `lo`, which every network namespace has. One `%d`
stands for a number, as in the kernel's own templates (`net%d`): the agent picks it for each device of the claim
as the kernel would in the pod (`backends.sriov.vf_netdev.numbered`), since the runtimes look the interface up by the
name they moved it under.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from backends.config import CONFIG_API_VERSION, OpaqueConfig, Reconfiguration
from backends.vfio import VfioConfig
from cdi.interface_names import IFNAMSIZ, KERNEL_WHITESPACE, kernel_name_problem

__all__ = ["IFNAMSIZ", "INTERFACE_NAME_SCHEMA", "NetDeviceRequest", "VfConfig", "interface_name_problem"]

LOOPBACK = "lo"

_NEVER_BYTES = KERNEL_WHITESPACE | frozenset(b"/:\0")


def _regex_class(chars: str) -> str:
    """Characters as a regular expression class body that RE2 (Kubernetes CEL), Python and ECMA-262 all read the
    same way: Latin-1 ones as `\\xhh`, others as themselves (RE2 has no `\\uhhhh`)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x100 else c for c in sorted(chars))


# The characters of one and two bytes in UTF-8 (up to U+07FF) the kernel refuses in a name, and `%`, which only
# `%d` may use. A class listing the wider characters with a byte 0xa0 would hold some 17,000 of them (every 64th
# code point from U+0800 on): the pattern leaves them to the agent, which refuses them at prepare.
_NOT_IN_NAME = _regex_class("%" + "".join(chr(c) for c in range(0x800) if _NEVER_BYTES.intersection(chr(c).encode())))
INTERFACE_NAME_SCHEMA: dict[str, Any] = {
    "minLength": 1,
    "x-maxBytes": IFNAMSIZ - 1,
    "pattern": f"^[^{_NOT_IN_NAME}]*(%d[^{_NOT_IN_NAME}]*)?$",
    "not": {"enum": [".", "..", LOOPBACK]},
    "description": "an interface name: no `/`, `:`, NUL or byte the kernel counts as whitespace (0x09 to 0x0d, "
                   "0x20, 0xa0 in UTF-8), and no `%` but one `%d`",
}
"""`interface_name_problem` in JSON schema terms, for the admission policy: `x-maxBytes` is the length in UTF-8 bytes
(JSON schema counts characters). It admits the names the agent takes, and refuses all the others but those with a
character of three or four bytes holding a byte 0xa0 (`†`, e2 80 a0)."""


def interface_name_problem(name: str) -> str | None:
    """Why `name` cannot be the name of the VF's interface in the pod, or None."""
    problem = kernel_name_problem(name)
    if problem is not None:
        return problem
    # The kernel's __dev_alloc_name: the first `%` must start `%d`, and no other may follow.
    if name.count("%") > 1 or ("%" in name and "%d" not in name):
        return (f"{name!r}: the only `%` an interface name may have is one `%d`, which stands for a number (the "
                "kernel refuses any other)")
    if name == LOOPBACK:
        return ("'lo' is the loopback interface, which every network namespace has: the pod's has it already, and "
                "moving the VF's interface in under that name would fail the pod ('File exists')")
    return None


class NetDeviceRequest(BaseModel):
    """`netDevice`: the name the VF's interface gets inside the pod."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The kernel's limit is checked below, with a message of its own.
    name: str = Field(max_length=64, json_schema_extra=INTERFACE_NAME_SCHEMA)

    @field_validator("name")
    @classmethod
    def _valid_interface_name(cls, name: str) -> str:
        problem = interface_name_problem(name)
        if problem is not None:
            raise PydanticCustomError("interface_name", problem)  # the message alone, no "Value error, "
        return name

    @property
    def templated(self) -> bool:
        """Whether the name has a `%d` for a number (`net%d`)."""
        return "%d" in self.name


class VfConfig(OpaqueConfig):
    """`apiVersion: dra-agent.io/v1alpha1`, `kind: VfConfig`: how a VF is handed to the claim's containers.

    `netDevice` (optional): move the VF's network interface into the pod under `netDevice.name`. Without it the VF
    is prepared as without configuration (its RDMA device, its interface left on the host). It cannot apply
    together with a `VfioConfig` for the same device (from the device class or the claim): vfio-pci takes the
    interface away.
    """

    API_VERSION: ClassVar[str] = CONFIG_API_VERSION
    KIND: ClassVar[str] = "VfConfig"
    RECONFIGURATIONS: ClassVar[tuple[Reconfiguration, ...]] = (
        Reconfiguration("VfConfig.netDevice", ("netDevice",),
                        what="moves the VF's network interface from the host into the pod"),
    )

    net_device: NetDeviceRequest | None = Field(default=None, alias="netDevice")

    def conflict(self, other: OpaqueConfig) -> str | None:
        if self.net_device is not None and isinstance(other, VfioConfig):
            return ("VfConfig.netDevice hands the VF's network interface to the pod, and VfioConfig binds the VF to "
                    "vfio-pci, which has no network interface: ask for one of them")
        return None
