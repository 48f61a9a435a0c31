"""A prepare environment for tests: a simulated node, its started backends, a Preparer per driver, claims."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.claims.cdi import CLASS, vendor
from agent.claims.checkpoint import Checkpoint
from agent.claims.collaborators import CLAIM_READ_SECONDS, ClaimMemory, ClaimSource, DriverDevices, Reporting
from agent.claims.metadata_files import MetadataFiles
from agent.claims.plan import Owner
from agent.claims.preparer import Preparer
from agent.logs import get_logger
from agent.node.host import Host
from agent.node.inventory import BackendReport, discover_all, start_all, stop_all
from agent.node.plugins import LoadedPlugin, find_plugins, load_plugins
from backends.contract import ClaimRef
from cdi.store import SpecStore
from simulator.node.node import SimulatedNode
from tests.support.agent_env import ALL_RECONFIGURATIONS, journal_entries

NODE = "node-a"


@dataclass
class FakeClaims:
    """ResourceClaims as a test API server would return them (the ClaimReader of the Preparer)."""

    claims: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    failing: str | None = None
    hanging: bool = False  # a read that never gets an answer (an API server stalled on connect)
    reads: int = 0

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.reads += 1
        if self.failing:
            raise RuntimeError(self.failing)
        if self.hanging:
            await asyncio.Event().wait()
        return self.claims.get((namespace, name))

    def add(self, name: str, results: list[tuple[str, str, str]], configs: list[dict[str, Any]] | None = None,
            namespace: str = "default") -> ClaimRef:
        """A claim allocated (request, driver, device) in this node's pools; returns the kubelet's reference."""
        uid = str(uuid.uuid4())
        self.claims[(namespace, name)] = {
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"allocation": {"devices": {
                "results": [{"request": r, "driver": d, "pool": NODE, "device": dev} for r, d, dev in results],
                "config": configs or [],
            }}},
        }
        return ClaimRef(uid, namespace, name)


@dataclass
class PrepareEnv:
    node: SimulatedNode
    root: Path
    claims: FakeClaims
    reports: list[BackendReport]
    plugins: list[LoadedPlugin]
    preparers: dict[str, Preparer] = field(default_factory=dict)

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def plugin_dir(self, driver: str) -> Path:
        """The driver's plugin data folder (where its device metadata files go)."""
        return self.root / "plugins" / driver

    def preparer(self, driver: str, boot_id: str | None = None, read_seconds: float = CLAIM_READ_SECONDS, *,
                 device_metadata: bool | None = None, reporting: Reporting | None = None) -> Preparer:
        """A (new) Preparer for a driver, as a (re)started agent would build it. `device_metadata`: the setting
        (None: the preparer has no metadata files at all); `reporting`: who hears of what it does."""
        owners: dict[str, Owner] = {}
        backends = {}
        for report in self.reports:
            if report.driver != driver:
                continue
            backends[report.name] = report.plugin.backend
            for device in report.inventory.devices if report.inventory else ():
                owners[device.name] = Owner(report.name, report.plugin.backend,
                                            tuple(getattr(report.plugin.backend, "config_types", ())))
        boot = boot_id or self.node.boot_id_file.read_text().strip()
        preparer = Preparer(
            DriverDevices(driver, NODE, backends, owners.get, allowed_configs=frozenset(ALL_RECONFIGURATIONS)),
            ClaimMemory(Checkpoint(self.root / "state" / driver / "checkpoint.journal", boot),
                        SpecStore(self.cdi_dir, vendor(driver), CLASS)),
            ClaimSource(self.claims, read_seconds),
            reporting=reporting or Reporting(get_logger("test")),
            metadata=None if device_metadata is None else MetadataFiles(
                driver, NODE, self.plugin_dir(driver), self.cdi_dir, enabled=device_metadata),
        )
        preparer.checkpoint.load()
        self.preparers[driver] = preparer
        return preparer

    def kept_of(self, preparer: Preparer, ref: ClaimRef) -> list[str]:
        """What is kept of a claim: its record, CDI specs and device metadata folder, its backends' journal entries
        (with `backend_state`)."""
        claims = preparer.checkpoint.claims
        found = [f"{claims[ref.uid].state} record"] if ref.uid in claims else []
        found += [p.name for p in self.cdi_dir.glob(f"*{ref.uid}*")]
        metadata = self.plugin_dir(preparer.driver) / "dra-device-metadata"
        found += [p.name for p in metadata.glob(f"{ref.namespace}_*")] if metadata.is_dir() else []
        found += [f"{journal.name}: {key}" for journal in (self.root / "backends").rglob("*.json")
                  for key, entry in journal_entries(journal).items() if ref.uid in f"{key} {entry}"]
        return found

    def devices(self, driver: str) -> list[str]:
        return sorted(d.name for r in self.reports if r.driver == driver and r.inventory for d in r.inventory.devices)

    async def close(self) -> None:
        for preparer in self.preparers.values():
            preparer.checkpoint.close()
        await stop_all(self.plugins)


async def prepare_env(node: SimulatedNode, root: Path, backends: tuple[str, ...] | None = None, *,
                      backend_state: bool = False) -> PrepareEnv:
    """`backend_state`: the backends keep their records under `root/backends` (what GPU passthrough needs)."""
    found, _ = find_plugins()
    loaded, _ = load_plugins(found, backends)
    host = Host(node.sysfs, node.dev, node.root, node.profile.name, driver_root=node.driver_root)
    started, errors = await start_all(loaded, host, lambda name: {},
                                      state_root=root / "backends" if backend_state else None)
    assert not errors, errors
    reports = await discover_all(started, lambda driver: driver)
    return PrepareEnv(node, root, FakeClaims(), reports, started)
