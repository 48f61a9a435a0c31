"""A process that watches a simulated node the way the agent does, for tests of udev events end to end.

Run under umockdev's preload (tests/support/udev_env.py starts it): opens the agent's udev monitor, starts the chosen
backends with it and prints, as JSON lines on stdout, every uevent it sees, every health event and device-set
change of the backends, and the devices each discovers after a change. Stops when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyudev

from agent.logs import configure_logging, get_logger
from agent.node.host import Host
from agent.node.plugins import find_plugins, load_plugins
from agent.node.udev import UdevMonitor, open_udev_monitor
from backends.contract import Backend, BackendContext, DevicesChanged
from backends.topology import TopologyReader


def say(**message: Any) -> None:
    print(json.dumps(message), flush=True)


class Subscriptions:
    """The monitor as a backend sees it, noting when the backend has subscribed."""

    def __init__(self, udev: UdevMonitor) -> None:
        self.udev = udev
        self.made = asyncio.Event()

    def subscribe(self, subsystem: str, handler: Callable[[pyudev.Device], None]) -> Callable[[], None]:
        self.made.set()
        return self.udev.subscribe(subsystem, handler)


async def follow(name: str, backend: Backend) -> None:
    async for event in backend.health():
        if isinstance(event, DevicesChanged):
            say(backend=name, changed=event.reason)
            inventory = await backend.discover()
            say(backend=name, devices=[d.name for d in inventory.devices])
        else:
            say(backend=name, health=[event.device, event.health.value, event.cause, event.reason])


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sim-root", type=Path, required=True)
    parser.add_argument("--backends", default="sriov-nic,tpu")
    parser.add_argument("--source", default="kernel", choices=("kernel", "udev"))
    parser.add_argument("--fail-on", default="", help="a device whose events make the watching handler raise")
    args = parser.parse_args()
    configure_logging("info", "json")
    root = args.sim_root
    udev = open_udev_monitor(Host(root / "sys", root / "dev", root, "harness", driver_root=root), args.source)
    say(monitor=udev is not None)
    if udev is None:
        return 1
    udev.start()

    def fail(device: pyudev.Device) -> None:
        if device.sys_name == args.fail_on:
            raise RuntimeError(f"handler fails on {device.sys_name}")

    def watch(device: pyudev.Device) -> None:
        say(udev=[device.action, device.subsystem, device.sys_name])

    for subsystem in ("pci", "net", "accel", "vfio"):
        udev.subscribe(subsystem, fail)  # first: the handler after it must get every event all the same
        udev.subscribe(subsystem, watch)
    loaded, failures = load_plugins(find_plugins()[0], tuple(args.backends.split(",")))
    assert not failures, failures
    topology = TopologyReader(root / "sys")
    tasks = []
    for plugin in loaded:
        name, backend = plugin.found.name, plugin.backend
        seen = Subscriptions(udev)
        await backend.start(BackendContext(root / "sys", root / "dev", root, topology, {}, get_logger(name),
                                           udev=seen, driver_root=root))
        inventory = await backend.discover()
        say(backend=name, devices=[d.name for d in inventory.devices])
        tasks.append(asyncio.create_task(follow(name, backend)))
        await seen.made.wait()
    say(ready=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    for plugin in loaded:
        await plugin.backend.stop()
    await asyncio.gather(*tasks)
    udev.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
