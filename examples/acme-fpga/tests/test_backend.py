"""What the conformance kit cannot know about this backend: its settings, its health source, its warnings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from acme_fpga.backend import AcmeFpgaBackend

from backends.plugin import BackendContext, ConfigError, Health, HealthEvent
from simulator.conformance import SimulatedNode, UdevInjector, backend_context, scaled, simulated_node

PROFILE = Path(__file__).parent.parent / "acme-node.yaml"
CARD = "0000:04:00.0"


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    with simulated_node(str(PROFILE)) as simulated:
        yield simulated


def context(node: SimulatedNode, config: dict[str, object] | None = None) -> BackendContext:
    return backend_context(node, config, name="acme-fpga-card", state_dir=node.root / "state")


async def next_event(stream: AsyncIterator[object]) -> HealthEvent:
    async with asyncio.timeout(scaled(5)):
        event = await anext(stream)
    assert isinstance(event, HealthEvent), event
    return event


def test_a_bad_pci_id_is_refused_at_start(node: SimulatedNode) -> None:
    with pytest.raises(ConfigError, match=r"ids\.0: Value error, 'acme' is not a PCI id"):
        asyncio.run(AcmeFpgaBackend().start(context(node, {"ids": ["acme"]})))


def test_a_card_on_another_driver_is_left_out_with_a_warning(node: SimulatedNode) -> None:
    async def discover() -> list[str]:
        backend = AcmeFpgaBackend()
        await backend.start(context(node))
        (node.sysfs / "bus/pci/devices" / CARD / "driver/unbind").write_text(CARD)
        # The simulated kernel unbinds a few milliseconds after the write; nothing to wait on but the link.
        async with asyncio.timeout(scaled(5)):
            while (node.sysfs / "bus/pci/devices" / CARD / "driver").exists():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        inventory = await backend.discover()
        await backend.stop()
        assert [d.name for d in inventory.devices] == ["fpga-0000-09-00-0"]
        return list(inventory.warnings)

    assert asyncio.run(discover()) == [f"FPGA {CARD}: bound to no driver, not acme_fpga; left out"]


def test_a_card_whose_device_node_goes_is_unhealthy_until_it_comes_back(node: SimulatedNode) -> None:
    async def watch() -> list[HealthEvent]:
        backend = AcmeFpgaBackend()
        await backend.start(context(node))
        await backend.discover()
        events: list[HealthEvent] = []
        stream = backend.health()
        await asyncio.to_thread(UdevInjector(node.root).node_remove, CARD)
        await backend.discover()  # a discovery re-checks the nodes, as an acme_fpga uevent would
        events.append(await next_event(stream))
        await asyncio.to_thread(UdevInjector(node.root).node_add, CARD)
        await backend.discover()
        events.append(await next_event(stream))
        await backend.stop()
        return events

    gone, back = asyncio.run(watch())
    assert (gone.device, gone.health, gone.cause) == ("fpga-0000-04-00-0", Health.UNHEALTHY, "device-node-missing")
    assert gone.reason == f"FPGA {CARD}: device node /dev/acme/fpga0 is missing"
    assert (back.device, back.health) == ("fpga-0000-04-00-0", Health.HEALTHY)
