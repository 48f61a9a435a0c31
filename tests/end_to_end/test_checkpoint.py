"""The checkpoint through `dra-agent run`: a batch of 64 claims prepared and unprepared in one call each leaves
nothing behind after a restart; a damaged journal stops the agent with a message naming the file, touching
nothing; moved aside, the agent keeps the claims it finds prepared from their CDI specs."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.contract import ClaimRef
from simulator.apiserver.server import TestApiServer
from simulator.kubelet import KubeletSimulator
from tests.support.agent_env import NODE, AgentProcess, allocate, plugin_after_restart, settings_for, wait_until
from tests.support.timing import scaled

NIC = "sriov.dra-agent.io"
VFIO = {"apiVersion": "dra-agent.io/v1alpha1", "kind": "VfioConfig"}


@pytest.fixture
async def server() -> AsyncIterator[TestApiServer]:
    async with TestApiServer() as api:
        api.add_node(NODE)
        yield api


def vfs(server: TestApiServer) -> list[str]:
    return sorted(d["name"] for s in server.objects("resourceslices") if s["spec"]["driver"] == NIC
                  for d in s["spec"]["devices"])


async def published_vfs(server: TestApiServer) -> list[str]:
    await wait_until(lambda: len(vfs(server)) == 64, timeout=scaled(30))
    return vfs(server)


def driver_of(sim_root: Path, bus_id: str) -> str | None:
    link = sim_root / "sys/bus/pci/devices" / bus_id / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


async def test_64_claims_unprepared_in_one_call_stay_unprepared_after_a_restart(server: TestApiServer,
                                                                                 scratch: Path) -> None:
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                            backends=("sriov-nic",))
    first, second = AgentProcess(settings), AgentProcess(settings)
    try:
        await first.start()
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            plugin = await kubelet.wait_for_plugin(NIC, timeout=scaled(30))
            names = await published_vfs(server)
            assert len(names) == 64
            claims = [allocate(server, f"c{n}", [("vf", NIC, vf)]) for n, vf in enumerate(names)]
            assert all(r.error == "" for r in (await plugin.prepare(claims)).values())
            assert await plugin.unprepare(claims) == {c.uid: "" for c in claims}
            await first.signal()
            assert await first.wait(timeout=scaled(15)) == 0

            await second.start()
            plugin = await plugin_after_restart(kubelet, plugin)
            assert list(settings.cdi_dir.iterdir()) == [], "no unprepared claim's spec came back"
            again = [allocate(server, f"d{n}", [("vf", NIC, vf)]) for n, vf in enumerate(names)]
            answers = await plugin.prepare(again)
            assert {uid: r.error for uid, r in answers.items()} == {c.uid: "" for c in again}, (
                "no VF is held by a claim answered as unprepared")
    finally:
        await first.stop()
        await second.stop()


async def test_a_uid_named_twice_in_one_call_gets_one_answer(server: TestApiServer, scratch: Path) -> None:
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                            backends=("sriov-nic",))
    agent = AgentProcess(settings)
    try:
        await agent.start()
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            plugin = await kubelet.wait_for_plugin(NIC, timeout=scaled(30))
            ref = allocate(server, "twice", [("vf", NIC, (await published_vfs(server))[0])])
            impostor = ClaimRef(ref.uid, ref.namespace, "other-name")
            answers = await plugin.prepare([ref, impostor])
            assert list(answers) == [ref.uid] and "appears in one request as" in answers[ref.uid].error
            answers = await plugin.prepare([ref, ref])
            assert list(answers) == [ref.uid] and answers[ref.uid].error == ""
            assert await plugin.unprepare([ref, ref]) == {ref.uid: ""}
    finally:
        await agent.stop()


@pytest.mark.parametrize("damage", ["random bytes", "emptied", "cut to 30 bytes", "NULs", "format one"])
async def test_a_damaged_checkpoint_stops_the_agent_and_touches_nothing(server: TestApiServer, scratch: Path,
                                                                          damage: str) -> None:
    settings = settings_for(scratch, server.write_kubeconfig(scratch / "kubeconfig"), "dgx-h100",
                            backends=("sriov-nic",))
    sim = settings.sim_root
    assert sim is not None
    first, refused, third = AgentProcess(settings), AgentProcess(settings), AgentProcess(settings)
    try:
        await first.start()
        async with KubeletSimulator(settings.registry_dir) as kubelet:
            plugin = await kubelet.wait_for_plugin(NIC, timeout=scaled(30))
            vf = (await published_vfs(server))[0]
            config = [{"source": "FromClaim", "requests": ["vf"], "opaque": {"driver": NIC, "parameters": VFIO}}]
            vm = allocate(server, "vm", [("vf", NIC, vf)], config)
            await plugin.prepare_or_raise([vm])
            assert driver_of(sim, "0000:19:00.1") == "vfio-pci"
            await first.stop()  # killed

            journal = settings.state_dir / NIC / "checkpoint.journal"
            data = journal.read_bytes()
            damaged = {
                "random bytes": os.urandom(len(data)),
                "emptied": b"",
                "cut to 30 bytes": data[:30],
                "NULs": b"\0" * len(data),
                "format one": data.replace(b'"format":2,"op":"claim"', b'"format":"one","op":"claim"'),
            }[damage]
            journal.write_bytes(damaged)
            specs = sorted(p.name for p in settings.cdi_dir.iterdir())
            await refused.start()
            assert await refused.wait(timeout=scaled(30)) == 1
            lines = [json.loads(line) for line in refused.output().splitlines() if line.startswith("{")]
            (error,) = [line for line in lines if line.get("event") == "cannot start"]
            assert f"checkpoint {journal} is damaged" in error["error"] and f"mv {journal}" in error["error"]
            assert "Traceback" not in refused.output()
            assert journal.read_bytes() == damaged, "the journal is left for the operator"
            assert sorted(p.name for p in settings.cdi_dir.iterdir()) == specs, "no spec deleted"
            assert driver_of(sim, "0000:19:00.1") == "vfio-pci", "no binding undone on a guess"
            (event,) = [e for e in server.events() if e.get("reason") == "CheckpointRefused"]
            assert event["regarding"]["kind"] == "Node" and str(journal) in event["note"]

            # What the message says to do: move it aside. The claim stays prepared, from its CDI spec.
            journal.rename(journal.with_name("checkpoint.journal.damaged"))
            await third.start()
            plugin = await plugin_after_restart(kubelet, plugin)
            assert driver_of(sim, "0000:19:00.1") == "vfio-pci"
            other = allocate(server, "other", [("vf", NIC, vf)])
            assert "already prepared for claim with UID" in (await plugin.prepare([other]))[other.uid].error
            assert await plugin.unprepare([vm]) == {vm.uid: ""}
            assert driver_of(sim, "0000:19:00.1") == "mlx5_core"
            assert (await plugin.prepare([other]))[other.uid].error == ""
    finally:
        for agent in (first, refused, third):
            await agent.stop()
