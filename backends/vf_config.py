"""`VfConfig`, the sriov-nic backend's claim configuration: hand the VF's network interface to the pod.

Pure. `netDevice: {name: net1}` asks for the VF's interface (its netdev) to be moved into the pod's network
namespace under that name; the agent writes it as a CDI `netDevices` edit and the container runtime moves it (see
`backends.vf_netdev`). The name follows the kernel's rules for an interface name (`dev_valid_name`): 1 to 15
bytes, not `.` or `..`, no `/`, `:` or whitespace; one `%d` may stand for a number the kernel picks inside the
pod (`net%d`), as the OCI runtime spec allows.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from backends.config import CONFIG_API_VERSION, OpaqueConfig
from backends.vfio import VfioConfig

__all__ = ["IFNAMSIZ", "INTERFACE_NAME_SCHEMA", "NetDeviceRequest", "VfConfig", "interface_name_problem"]

IFNAMSIZ = 16
"""The kernel's buffer for an interface name, its terminating NUL included: names have at most 15 bytes."""

# What an interface name cannot contain: `/`, `:`, NUL and whitespace (what str.isspace() calls whitespace).
_SPACES = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
           "\u200a\u2028\u2029\u202f\u205f\u3000")
_FORBIDDEN = frozenset("/:\0" + _SPACES)


def _regex_class(chars: str) -> str:
    """Characters as a regular expression class body that RE2 (Kubernetes CEL), Python and ECMA-262 all read the
    same way: Latin-1 ones as `\\xhh`, others as themselves (RE2 has no `\\uhhhh`)."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x100 else c for c in sorted(chars))


_NOT_IN_NAME = _regex_class("%" + "".join(_FORBIDDEN))
INTERFACE_NAME_SCHEMA: dict[str, Any] = {
    "minLength": 1,
    "x-maxBytes": IFNAMSIZ - 1,
    "pattern": f"^[^{_NOT_IN_NAME}]*(%d[^{_NOT_IN_NAME}]*)?$",
    "not": {"enum": [".", ".."]},
    "description": "an interface name: no `/`, `:`, NUL or whitespace, and no `%` but one `%d`",
}
"""`interface_name_problem` in JSON schema terms, for the admission policy: `x-maxBytes` is the length in UTF-8 bytes
(JSON schema counts characters)."""


def interface_name_problem(name: str) -> str | None:
    """Why the kernel would refuse `name` as the name of a network interface in the pod, or None."""
    size = len(name.encode())
    if size == 0:
        return "an interface name cannot be empty"
    if size >= IFNAMSIZ:
        return f"an interface name has at most {IFNAMSIZ - 1} bytes, {name!r} has {size}"
    if name in (".", ".."):
        return f"{name!r} is not an interface name"
    bad = sorted({c for c in name if c in _FORBIDDEN})
    if bad:
        return f"an interface name cannot contain {', '.join(repr(c) for c in bad)}"
    # The kernel fills in one number where the name has `%d`, and refuses any other `%`.
    if name.count("%") > 1 or ("%" in name and "%d" not in name):
        return f"{name!r}: the only `%` an interface name may have is one `%d` (the kernel picks the number)"
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
            raise ValueError(problem)
        return name

    @property
    def templated(self) -> bool:
        """Whether the kernel picks the number in the name inside the pod (`net%d`)."""
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

    net_device: NetDeviceRequest | None = Field(default=None, alias="netDevice")

    def conflict(self, other: OpaqueConfig) -> str | None:
        if self.net_device is not None and isinstance(other, VfioConfig):
            return ("VfConfig.netDevice hands the VF's network interface to the pod, and VfioConfig binds the VF to "
                    "vfio-pci, which has no network interface: ask for one of them")
        return None
