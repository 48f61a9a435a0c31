"""VF counts from the sriov-nic configuration: applied through 0 as the kernel requires, published, refused for
PFs that carry the host's traffic or whose VFs claims hold, invalid counts reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.settings import Settings
from backends.config import parse_config
from backends.contract import ConfigError
from backends.sriov.backend import SriovBackendConfig
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import agent_in_process, allocate, wait_until
from tests.support.timing import scaled

NIC = "sriov.dra-agent.io"
PF, PF_NETDEV = "0000:19:00.0", "enp25s0f0np0"  # dgx-h100's first ConnectX-7: 64 VFs possible, 8 enabled


def vfs_of(env: Any, pf: str) -> list[str]:
    return sorted(d.name for d in env.agent.drivers[NIC].pool.devices
                  if d.attributes.get("pfPciBusID") == pf)


def numvfs(settings: Settings) -> int:
    assert settings.sim_root is not None
    return int((settings.sim_root / "sys/bus/pci/devices" / PF / "sriov_numvfs").read_text())


async def test_sixteen_vfs_on_a_pf_with_eight_are_published(scratch: Path) -> None:
    config = {"sriov-nic": {"numVfs": [{"pf": PF_NETDEV, "count": 16}, {"pf": "15b3:1021", "count": 4}]}}
    async with agent_in_process(scratch, "dgx-h100", backend_config=config, backends=("sriov-nic",)) as env:
        await wait_until(lambda: len(vfs_of(env, PF)) == 16, timeout=scaled(15))
        assert numvfs(env.settings) == 16
        # The other ConnectX-7 PFs match the vendor:device rule.
        assert len(vfs_of(env, "0000:1d:00.0")) == 4
        await wait_until(lambda: len(env.server.objects("resourceslices")) > 0)


async def test_a_pf_with_the_hosts_default_route_is_left_alone(scratch: Path) -> None:
    config = {"sriov-nic": {"numVfs": [{"pf": PF, "count": 2}]}}
    async with agent_in_process(scratch, "dgx-h100", backends=("sriov-nic",)):
        pass  # the node exists from now on, as a host does
    route = scratch / "node/proc/1/net/route"
    route.parent.mkdir(parents=True, exist_ok=True)  # a host has it: a simulated node too
    route.write_text("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
                     f"{PF_NETDEV}\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")
    async with agent_in_process(scratch, "dgx-h100", backend_config=config, backends=("sriov-nic",)) as env:
        await env.agent.drivers[NIC].published.wait()
        assert len(vfs_of(env, PF)) == 8 and numvfs(env.settings) == 8


async def test_vfs_held_by_a_claim_keep_their_pf_as_it_is(scratch: Path) -> None:
    async with agent_in_process(scratch, "dgx-h100", backends=("sriov-nic",)) as env, \
            KubeletSimulator(env.settings.registry_dir) as kubelet:
        plugin = await kubelet.wait_for_plugin(NIC)
        vf = vfs_of(env, PF)[0]
        claim = allocate(env.server, "net", [("nic", NIC, vf)])
        await plugin.prepare_or_raise([claim])
    # Restarted with a new VF count for that PF: its VF is prepared, so the PF stays at 8.
    config = {"sriov-nic": {"numVfs": [{"pf": PF, "count": 16}]}}
    async with agent_in_process(scratch, "dgx-h100", backend_config=config, backends=("sriov-nic",)) as env:
        await env.agent.drivers[NIC].published.wait()
        assert len(vfs_of(env, PF)) == 8 and numvfs(env.settings) == 8


@pytest.mark.parametrize(("rules", "message"), [
    ([{"pf": PF, "count": -1}], "greater than or equal to 0"),
    ([{"pf": "0000:zz:00.0", "count": 4}], "neither an interface name, a PCI address nor vendor:device"),
    ([{"pf": PF}], "count: Field required"),
    ([{"pf": PF, "count": 4, "mode": "x"}], "Extra inputs are not permitted"),
])
def test_invalid_rules_are_refused_with_the_reason(rules: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(SriovBackendConfig, {"numVfs": rules}, "sriov-nic")


async def test_a_count_above_what_the_pf_supports_is_reported_for_that_pf(scratch: Path) -> None:
    config = {"sriov-nic": {"numVfs": [{"pf": PF, "count": 100}, {"pf": "0000:1d:00.0", "count": 2}]}}
    async with agent_in_process(scratch, "dgx-h100", backend_config=config, backends=("sriov-nic",)) as env:
        await wait_until(lambda: len(vfs_of(env, "0000:1d:00.0")) == 2, timeout=scaled(15))
        assert len(vfs_of(env, PF)) == 8, "the PF asked for too many keeps what it has"
