"""The built-in backends pass the conformance kit that third-party backends are held to, each on a node that
holds its hardware: every check of `BackendSuite` runs for every target below."""

from __future__ import annotations

import pytest

from backends.config import CONFIG_API_VERSION
from simulator.conformance import BackendSuite, Target
from tests.support.repository import SUPPORT

PROFILES = SUPPORT / "conformance_profiles"
VFIO = {"apiVersion": CONFIG_API_VERSION, "kind": "VfioConfig"}

TARGETS = [
    Target("nvidia-gpu", "gke-n1-t4x2",
           claim_config={"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", "driverCapabilities": ["compute"]}),
    Target("nvidia-gpu", "gke-n1-t4x2", claim_config=VFIO),
    Target("nvidia-mig", PROFILES / "mig-node.yaml", config={"mode": "dynamic"},
           prepare_devices=["gpu-0000-03-00-0-mig-1g10gb-19-0"]),
    Target("sriov-nic", PROFILES / "sriov-node.yaml", claim_config=VFIO, devices_per_claim=2),
    Target("tpu", PROFILES / "tpu-node.yaml", devices_per_claim=2),
]


def _id(target: Target) -> str:
    kind = (target.claim_config or {}).get("kind")
    return f"{target.id}-{kind}" if kind else target.id


@pytest.fixture(params=TARGETS, ids=[_id(t) for t in TARGETS])
def conformance_target(request: pytest.FixtureRequest) -> Target:
    target: Target = request.param
    return target


class TestBuiltinBackends(BackendSuite):
    pass
