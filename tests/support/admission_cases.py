"""Opaque parameters for the agent's drivers: chosen to cover each rule of the admission policy once, valid and
invalid, with the field each invalid one names; generated (valid ones, and ones mutated by unknown fields, wrong
types, values out of range and unknown types); and the claim or template that carries them. Also the reconfiguration
policy's cases: parameters with the ConfigMap that lists the namespaces allowed each reconfiguration. Shared by the
policies' tests with cel-python and by the real API server's tests of the same policies."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from backends.config import CONFIG_API_VERSION

__all__ = ["CHOSEN", "GPU", "MAPS", "RECONFIGURATION_CASES", "SRIOV", "TPU", "VFIO", "allowed_in", "as_policy_names",
           "claim", "config_map_data", "gpu", "mutated", "valid_parameters", "vf"]

GPU, SRIOV, TPU = "gpu.nvidia.com", "sriov.dra-agent.io", "tpu.google.com"


MAPS = ("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",)
"""Fields holding a map: the agent names the entry (`...Limit.gpu-a`), the policy the map (its message is static)."""


def as_policy_names(field: str) -> str:
    """A field the agent names, as the policy names it: an entry of a map counts as the map."""
    return next((m for m in MAPS if field.startswith(m + ".")), field)


def claim(driver: str, parameters: Any, template: bool = False, namespace: str = "default") -> dict[str, Any]:
    """A ResourceClaim (or a ResourceClaimTemplate) with one opaque configuration entry, and another driver's."""
    devices = {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}], "config": [
        {"opaque": {"driver": "other.example.com", "parameters": {"anything": [1, "goes"]}}},
        {"requests": ["r"], "opaque": {"driver": driver, "parameters": parameters}},
    ]}
    if template:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "t", "namespace": namespace}, "spec": {"spec": {"devices": devices}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": namespace}, "spec": {"devices": devices}}


def gpu(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", **fields}


def vf(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": CONFIG_API_VERSION, "kind": "VfConfig", **fields}


VFIO = {"apiVersion": CONFIG_API_VERSION, "kind": "VfioConfig"}

CHOSEN: list[tuple[str, Any, str | None]] = [
    (GPU, gpu(), None),
    (GPU, gpu(driverCapabilities=["compute", "video"], sharing={"strategy": "TimeSlicing"}), None),
    (GPU, gpu(sharing=None), None),
    (GPU, VFIO, None),
    (SRIOV, vf(netDevice={"name": "net%d"}), None),
    (SRIOV, VFIO, None),
    (GPU, gpu(sharing={"strategy": "MPS"}), None),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "4Gi",
        "defaultPerDevicePinnedMemoryLimit": {"gpu-0000-18-00-0": "2G", "GPU-0d0e0f10": "1073741824"}}}), None),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
     "sharing.mpsConfig.defaultActiveThreadPercentage"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
     "sharing.mpsConfig.defaultActiveThreadPercentage"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50%"}}),
     "sharing.mpsConfig.defaultActiveThreadPercentage"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "100"}}),
     "sharing.mpsConfig.defaultActiveThreadPercentage"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1.5Gi"}}),
     "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"gpu-a": "-1"}}}),
     "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {
        f"gpu-{i}": "1Gi" for i in range(33)}}}), "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": True}}), "sharing.mpsConfig.multiUser"),
    (GPU, gpu(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}), "sharing.mpsConfig"),
    (GPU, gpu(sharing={"strategy": "RoundRobin"}), "sharing.strategy"),
    (GPU, gpu(sharing={}), "sharing.strategy"),
    (GPU, gpu(sharing="TimeSlicing"), "sharing"),
    (GPU, gpu(sharing={"strategy": "TimeSlicing", "interval": "Long"}), "sharing.interval"),
    (GPU, gpu(driverCapabilities=["compute", "teleport"]), "driverCapabilities"),
    (GPU, gpu(driverCapabilities=[]), "driverCapabilities"),
    (GPU, gpu(devices=["/dev/sda"]), "devices"),
    (GPU, vf(), "kind"),
    (GPU, {"apiVersion": "dra-agent.io/v1", "kind": "GpuConfig"}, "kind"),
    (GPU, {"kind": "GpuConfig"}, "kind"),
    (GPU, {"apiVersion": 1, "kind": ["GpuConfig"]}, "kind"),
    (SRIOV, vf(netDevice={"name": "eth0:1"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "a-very-long-name0"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "ü" * 8}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": ".."}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "net%d%d"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "netà"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "lo"}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "\u2003x"}), None),
    (SRIOV, vf(netDevice={"name": "a\x1cb"}), None),
    (SRIOV, vf(netDevice={}), "netDevice.name"),
    (SRIOV, vf(netDevice={"name": "net1", "mtu": 9000}), "netDevice.mtu"),
    (SRIOV, {**VFIO, "iommu": "off"}, "iommu"),
    (TPU, gpu(), "kind"),
]
"""(driver, parameters, the first field the policy names: None when the parameters are valid)."""


# Generated parameters

_NAME_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_.%d/: \t\u00a0\u2028\u2003éà")
_ODD_CHARS = st.sampled_from("%/: \t\n\0\x1c\x85\u00a0\u2028\u2003\u3000éà\u0420.")
_PLAIN = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_"), max_size=9)
# Plain names, names with one character out of the ordinary, names from anything.
interface_names = st.one_of(_PLAIN, st.builds(lambda a, c, b: a + c + b, _PLAIN, _ODD_CHARS, _PLAIN),
                            st.builds(lambda a, b: a + "%d" + b, _PLAIN, _PLAIN), st.text(_NAME_CHARS, max_size=18),
                            st.sampled_from(["net1", "net%d", ".", "..", "", "lo", "lo0"]))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=8), st.sampled_from(["compute", "MPS", "TimeSlicing", "GpuConfig"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
field_names = st.one_of(st.from_regex(r"[a-zA-Z][a-zA-Z0-9]{0,8}", fullmatch=True),
                        st.sampled_from(["strategy", "name", "sharing", "TimeSlicing", "kind"]))


_LIMITS = st.builds(lambda n, suffix: f"{n}{suffix}", st.integers(0, 10**6),
                    st.sampled_from(["", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti"]))


@st.composite
def mps_configs(draw: st.DrawFn) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if draw(st.booleans()):
        config["defaultActiveThreadPercentage"] = draw(st.integers(1, 100))
    if draw(st.booleans()):
        config["defaultPinnedDeviceMemoryLimit"] = draw(_LIMITS)
    if draw(st.booleans()):
        config["defaultPerDevicePinnedMemoryLimit"] = draw(st.dictionaries(
            st.from_regex(r"gpu-[0-9a-f]{1,8}", fullmatch=True), _LIMITS, max_size=3))
    return config


@st.composite
def valid_parameters(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["GpuConfig", "VfConfig", "VfioConfig"]))
    params: dict[str, Any] = {"apiVersion": CONFIG_API_VERSION, "kind": kind}
    if kind == "GpuConfig":
        driver = GPU
        if draw(st.booleans()):
            params["driverCapabilities"] = draw(st.lists(st.sampled_from(["compute", "utility", "video", "graphics"]),
                                                         min_size=1, max_size=4))
        sharing = draw(st.sampled_from([None, "absent", "TimeSlicing", "ExclusiveProcess", "MPS"]))
        if sharing != "absent":
            params["sharing"] = None if sharing is None else {"strategy": sharing}
        if sharing == "MPS" and draw(st.booleans()):
            params["sharing"]["mpsConfig"] = draw(mps_configs())
    elif kind == "VfConfig":
        driver = SRIOV
        net = draw(st.sampled_from(["absent", None, "named"]))
        if net != "absent":
            params["netDevice"] = None if net is None else {"name": draw(interface_names)}
    else:
        driver = draw(st.sampled_from([GPU, SRIOV]))
    return driver, params


def _objects(params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object in the parameters, the parameters themselves first."""
    found = [params]
    for value in params.values():
        if isinstance(value, dict):
            found += _objects(value)
    return found


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    driver, params = draw(valid_parameters())
    params = copy.deepcopy(params)
    for _ in range(draw(st.integers(0, 2))):
        how = draw(st.sampled_from(["unknown field", "wrong value", "out of range", "drop", "type", "driver"]))
        obj = draw(st.sampled_from(_objects(params)))
        if how == "unknown field":
            obj[draw(field_names)] = draw(json_values)
        elif how == "wrong value" and obj:
            obj[draw(st.sampled_from(sorted(obj)))] = draw(json_values)
        elif how == "out of range":
            choice = draw(st.sampled_from(["caps", "strategy", "name", "mps"]))
            if choice == "caps":
                params["driverCapabilities"] = draw(st.lists(st.sampled_from(["compute", "utility", "teleport"]),
                                                             max_size=6))
            elif choice == "strategy":
                params["sharing"] = {"strategy": draw(st.sampled_from(["MPS", "RoundRobin", "", "timeslicing"]))}
            elif choice == "mps":
                params["sharing"] = {"strategy": "MPS", "mpsConfig": {
                    draw(st.sampled_from(["defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit"])):
                    draw(st.one_of(st.integers(-5, 200), st.sampled_from(["1.5Gi", "4Gb", "-1", "", "4Gi", "100"])))}}
            else:
                params["netDevice"] = {"name": draw(st.text(_NAME_CHARS, min_size=14, max_size=70))}
        elif how == "drop" and obj:
            del obj[draw(st.sampled_from(sorted(obj)))]
        elif how == "type":
            params["kind"] = draw(st.sampled_from(["GpuConfig", "VfConfig", "VfioConfig", "TpuConfig", "gpuconfig"]))
            if draw(st.booleans()):
                params["apiVersion"] = draw(st.sampled_from(["dra-agent.io/v1", "v1", CONFIG_API_VERSION]))
        elif how == "driver":
            driver = draw(st.sampled_from([GPU, SRIOV, TPU]))
    return driver, params


# The reconfiguration policy: who may ask for what

RECONFIGURATION_CASES: list[tuple[str, Any, dict[str, str], str | None]] = [
    # (driver, parameters, the ConfigMap's data, the reconfiguration refused in namespace "vms"; None: admitted)
    (GPU, VFIO, {}, "VfioConfig"),
    (GPU, VFIO, {"VfioConfig": "vms"}, None),
    (SRIOV, VFIO, {"VfioConfig": "kubevirt, vms ,dpdk"}, None),
    (GPU, VFIO, {"VfioConfig": "vms-2,kubevirt"}, "VfioConfig"),
    (GPU, VFIO, {"VfioConfig": "*"}, None),
    (GPU, VFIO, {"VfioConfig": ""}, "VfioConfig"),
    (GPU, VFIO, {"vfioconfig": "vms"}, "VfioConfig"),
    (GPU, gpu(), {}, None),
    (GPU, gpu(driverCapabilities=["compute", "video"], sharing=None), {}, None),
    (GPU, gpu(sharing={"strategy": "TimeSlicing"}), {"VfioConfig": "*"}, "GpuConfig.sharing.TimeSlicing"),
    (GPU, gpu(sharing={"strategy": "TimeSlicing"}), {"GpuConfig.sharing.TimeSlicing": "vms"}, None),
    (GPU, gpu(sharing={"strategy": "ExclusiveProcess"}), {"GpuConfig.sharing.TimeSlicing": "*"},
     "GpuConfig.sharing.ExclusiveProcess"),
    (GPU, gpu(sharing={"strategy": "MPS"}), {"GpuConfig.sharing.TimeSlicing": "*"}, "GpuConfig.sharing.MPS"),
    (GPU, gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
     {"GpuConfig.sharing.MPS": "vms"}, None),
    (SRIOV, vf(), {}, None),
    (SRIOV, vf(netDevice=None), {}, None),
    (SRIOV, vf(netDevice={"name": "net1"}), {}, "VfConfig.netDevice"),
    (SRIOV, vf(netDevice={"name": "net1"}), {"VfConfig.netDevice": "*"}, None),
    # Another driver's parameters are not the agent's to judge.
    ("other.example.com", VFIO, {}, None),
]


def allowed_in(data: dict[str, str], namespace: str) -> set[str]:
    """The reconfigurations the ConfigMap's data allows in `namespace`, read as the policy is documented to read it."""
    return {name for name, value in data.items()
            if any(n.strip() in (namespace, "*") for n in value.split(","))}


reconfiguration_names = st.sampled_from(["VfioConfig", "GpuConfig.sharing.TimeSlicing",
                                         "GpuConfig.sharing.ExclusiveProcess", "GpuConfig.sharing.MPS",
                                         "VfConfig.netDevice"])
namespace_lists = st.lists(st.sampled_from(["vms", "team-a", "*", " vms ", "", "vms2"]), max_size=3).map(",".join)
config_map_data = st.dictionaries(reconfiguration_names, namespace_lists, max_size=4)
