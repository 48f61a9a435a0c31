"""The committed gRPC stubs are what the .proto files generate, and the wire names match the kubelet's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from agent.kubelet._proto import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2
from tests.support.repository import ROOT

PROTO = ROOT / "agent" / "kubelet" / "_proto"


def test_stubs_are_generated_from_the_protos(scratch: Path) -> None:
    copy = scratch / "agent" / "kubelet" / "_proto"
    copy.mkdir(parents=True)
    for proto in PROTO.glob("*.proto"):
        shutil.copy(proto, copy)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.",
         *(f"agent/kubelet/_proto/{p.name}" for p in PROTO.glob("*.proto"))],
        cwd=scratch, check=True,
    )
    generated = sorted(p.name for p in copy.iterdir() if not p.name.endswith(".proto"))
    committed = sorted(p.name for p in PROTO.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    assert generated == committed
    for name in generated:
        stale = f"{name} is stale: run scripts/generate-protos"
        assert (copy / name).read_bytes() == (PROTO / name).read_bytes(), stale


def test_wire_names_and_field_numbers() -> None:
    services = {
        dra_v1_pb2: "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
        dra_v1beta1_pb2: "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
        dra_health_v1alpha1_pb2: "v1alpha1.DRAResourceHealth",
        pluginregistration_v1_pb2: "pluginregistration.Registration",
    }
    for module, full_name in services.items():
        (service,) = module.DESCRIPTOR.services_by_name.values()
        assert service.full_name == full_name
    device = dra_v1_pb2.Device.DESCRIPTOR
    assert {f.name: f.number for f in device.fields} == {
        "request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    claim = dra_v1_pb2.Claim.DESCRIPTOR
    assert {f.name: f.number for f in claim.fields} == {"namespace": 1, "uid": 2, "name": 3}
    health = dra_health_v1alpha1_pb2.DeviceHealth.DESCRIPTOR
    assert {f.name: f.number for f in health.fields} == {
        "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4, "message": 5}
    assert dict(dra_health_v1alpha1_pb2.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    info = pluginregistration_v1_pb2.PluginInfo.DESCRIPTOR
    assert {f.name: f.number for f in info.fields} == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    status = pluginregistration_v1_pb2.RegistrationStatus.DESCRIPTOR
    assert {f.name: f.number for f in status.fields} == {"plugin_registered": 1, "error": 2}
