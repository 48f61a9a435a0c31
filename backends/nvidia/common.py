"""What the NVIDIA backends share: their base class (configuration and health stream), one NVML read per
discovery, and the attributes every NVIDIA device carries (full GPU or MIG): product, architecture and version
facts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from structlog.typing import FilteringBoundLogger

from backends.base import BackendBase
from backends.contract import (
    Allocated,
    AttributeValue,
    BackendContext,
    Device,
    DevicesChanged,
    HealthEvent,
    Inventory,
    Unserved,
    Version,
)
from backends.nvidia.config import DEFAULT_GPU_CONFIG, GpuBackendConfig, GpuConfig, NvidiaHealthConfig
from backends.nvidia.driver_files import Capability, driver_mounts
from backends.nvidia.driver_root import DriverRoot
from backends.nvidia.health_feed import HealthFeed
from backends.nvidia.health_rules import DeviceRef
from backends.nvidia.nvml import (
    GpuInfo,
    GpuProblem,
    NvmlError,
    NvmlUnavailable,
    SystemInfo,
    list_gpus,
    loaded_library,
    nvml_session,
    system_info,
    use_driver_root,
)
from backends.sysfs import SysfsError, list_pci_devices, read_hex, read_link_name
from cdi.spec import ContainerEdits, DeviceNode

__all__ = ["NvidiaBackend", "clip", "gpu_attributes", "nvidia_gpus_in_sysfs", "read_nvml"]

_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_NVIDIA, _DISPLAY_CLASS, _PASSTHROUGH = 0x10DE, 0x03, "vfio-pci"
_FIRST_RETRY = 1.0

Reader = Callable[[SystemInfo, list[GpuInfo], list[GpuProblem]], Inventory]


class NvidiaBackend(BackendBase):
    """Base of nvidia-gpu and nvidia-mig: typed health settings and a health stream over the shared watcher.

    Subclasses call `watch(devices)` after each discovery with what every published device is in NVML terms.
    """

    config_model: ClassVar[type[NvidiaHealthConfig]] = GpuBackendConfig

    def __init__(self) -> None:
        super().__init__()
        self._feed: HealthFeed | None = None
        self._driver: DriverRoot | None = None
        self._driver_version = ""
        self._warned_no_files = False
        # Control nodes and driver files per set of capabilities: the same for every claim until the driver
        # changes, and finding them costs a few hundred microseconds of file system lookups.
        self._common: dict[tuple[Capability, ...], ContainerEdits] = {}
        self._library: Path | None = None  # the NVML library those were found beside
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nvml_missing = asyncio.Event()  # the last discovery found GPUs NVML could not serve
        self._retry_limit = 30.0

    def driver_version_seen(self, version: str) -> None:
        """Discovery read the driver's version: a new driver has new files."""
        if version != self._driver_version:
            self._common = {}
        self._driver_version = version

    async def common_edits(self, devices: Sequence[Allocated]) -> ContainerEdits:
        """What every container of a claim gets: the control nodes and the driver's files for the capabilities
        the claim's GpuConfig asks for (compute and utility by default)."""
        capabilities: list[Capability] = []
        for allocated in devices:
            config = allocated.config if isinstance(allocated.config, GpuConfig) else DEFAULT_GPU_CONFIG
            capabilities.extend(config.driver_capabilities)
        wanted = tuple(dict.fromkeys(capabilities))
        library = loaded_library()
        if library != self._library:  # another driver's files (a driver container restarted, upgraded)
            self._common, self._library = {}, library
        common = self._common.get(wanted)
        if common is None:
            common = self._common[wanted] = await asyncio.to_thread(self._find_common_edits, wanted)
        return common

    @property
    def driver_root(self) -> DriverRoot:
        """The NVIDIA driver's root: where its files and device nodes are, here and on the host."""
        if self._driver is None:
            raise RuntimeError(f"backend {self.name} used before start()")
        return self._driver

    def device_node(self, name: str) -> DeviceNode:
        """The driver's device node `name` (nvidia0, nvidia-caps/nvidia-cap12, ...) for a container: at /dev/<name>
        in it, from where the host has it (the driver container's own /dev when it has one)."""
        return DeviceNode(f"/dev/{name}", host_path=self.driver_root.device_host_path(name))

    def _find_common_edits(self, capabilities: tuple[Capability, ...]) -> ContainerEdits:
        devices = self.driver_root.device_root()
        nodes = tuple(self.device_node(name) for name in _CONTROL_NODES if (devices / name).exists())
        mounts = driver_mounts(self.driver_root, self._driver_version, capabilities, loaded_library())
        if not mounts and not self._warned_no_files:
            self._warned_no_files = True
            self.ctx.log.warning("no NVIDIA driver libraries or binaries found in the driver root; containers get "
                                 "device nodes only", driver_root=str(self.driver_root.root))
        return ContainerEdits(device_nodes=nodes, mounts=mounts)

    async def start(self, ctx: BackendContext) -> None:
        await super().start(ctx)
        self._driver = DriverRoot(ctx.host_root, ctx.driver_root, ctx.dev_root)
        use_driver_root(self._driver)
        config = self._config
        assert isinstance(config, NvidiaHealthConfig)
        self._feed = HealthFeed(log=ctx.log, ignored_xids=config.ignored_xids, recheck_seconds=config.recheck_seconds,
                                sysfs_root=ctx.sysfs_root, udev=ctx.udev, registry=ctx.registry)
        self._loop = asyncio.get_running_loop()
        self._retry_limit = config.nvml_retry_seconds

    def read_nvml(self, read: Reader) -> Inventory:
        """`read_nvml` for this backend (from a worker thread); GPUs it cannot serve make it look for NVML again
        (see `health`)."""
        inventory = read_nvml(self.ctx.log, self.ctx.sysfs_root, read)
        if inventory.unserved and self._loop is not None:
            self._loop.call_soon_threadsafe(self._nvml_missing.set)
        return inventory

    def watch(self, devices: Mapping[str, DeviceRef]) -> None:
        if self._feed is not None:
            self._feed.set_devices(devices)

    async def health(self) -> AsyncIterator[HealthEvent | DevicesChanged]:
        """Xid, ECC, lost and unmonitored GPUs as health events of the devices on them; hot-plug as DevicesChanged.
        Watching starts with the first iteration, so a one-off discovery never starts the watcher thread."""
        if self._feed is None:
            return
        retry = asyncio.create_task(self._look_for_nvml(self._feed), name=f"{self.name}: look for NVML")
        try:
            async for item in self._feed.stream(self._stopped):
                yield item
        finally:
            retry.cancel()
            await asyncio.gather(retry, return_exceptions=True)

    async def _look_for_nvml(self, feed: HealthFeed) -> None:
        """While the last discovery found GPUs NVML could not serve, try NVML again (1 s later, then twice as long
        each time up to `nvmlRetrySeconds`); once it starts, have the health stream ask for a new discovery."""
        while True:
            await self._nvml_missing.wait()
            delay = _FIRST_RETRY
            while self._nvml_missing.is_set():
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_limit)
                if await asyncio.to_thread(_nvml_starts):
                    self._nvml_missing.clear()
                    feed.devices_changed(f"NVML can be used now ({loaded_library()})")

    async def stop(self) -> None:
        await super().stop()  # ends the health stream
        if self._feed is not None:
            await self._feed.close()


def read_nvml(log: FilteringBoundLogger, sysfs_root: Path, read: Reader) -> Inventory:
    """Run `read` over the GPUs NVML sees, inside one NVML session (blocking: call from a worker thread).

    NVML that cannot be used is no error on a node without NVIDIA GPUs (an empty inventory); on a node with
    some, they are `Unserved`, with every place NVML was looked for and its error. NVML failing otherwise is a
    warning.
    """
    try:
        with nvml_session():
            system = system_info()
            gpus, problems = list_gpus()
            return read(system, gpus, problems)
    except NvmlUnavailable as e:
        present = nvidia_gpus_in_sysfs(sysfs_root)
        if not present:
            log.debug("no NVIDIA GPU and no NVIDIA driver on this node", reason=str(e))
            return Inventory()
        return Inventory(unserved=(Unserved(tuple(present), f"NVIDIA GPUs are on the node but NVML cannot be used: "
                                            f"{e}; is the driver root set to where the driver is seen (see "
                                            "--driver-root in docs/deploy.md)?"),))
    except NvmlError as e:
        return Inventory(warnings=(f"NVML: {e}",))


def nvidia_gpus_in_sysfs(sysfs_root: Path) -> list[str]:
    """PCI addresses of the node's NVIDIA GPUs (vendor 0x10de, display or 3D controller) that NVML would serve:
    all but those passed through on vfio-pci."""
    found = []
    for bus_id in list_pci_devices(sysfs_root):
        function = sysfs_root / "bus/pci/devices" / bus_id
        try:
            vendor, klass = read_hex(function / "vendor"), read_hex(function / "class")
            bound = read_link_name(function / "driver")
        except SysfsError:
            continue
        if vendor == _NVIDIA and klass is not None and klass >> 16 == _DISPLAY_CLASS and bound != _PASSTHROUGH:
            found.append(bus_id)
    return found


def _nvml_starts() -> bool:
    try:
        with nvml_session():
            return True
    except NvmlError:
        return False


def clip(text: str, limit: int = 64) -> str:
    """Cut a string attribute to the API's 64-byte limit without splitting a UTF-8 character."""
    return text.encode()[:limit].decode(errors="ignore")


def gpu_attributes(gpu: GpuInfo, system: SystemInfo) -> tuple[dict[str, AttributeValue], list[str]]:
    """Attributes shared by a GPU and its MIG devices, and problems with values that cannot be published."""
    problems: list[str] = []
    attrs: dict[str, AttributeValue] = {
        "productName": clip(gpu.product_name),
        "brand": gpu.brand,
        "architecture": gpu.architecture,
        "cudaComputeCapability": Version(f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]}.0"),
    }
    try:
        attrs["driverVersion"] = Version.lenient(system.driver_version)
    except ValueError as e:
        problems.append(f"driverVersion left out: {e}")
    cuda = system.cuda_driver_version
    attrs["cudaDriverVersion"] = Version(f"{cuda // 1000}.{cuda % 1000 // 10}.0")
    return attrs, problems


def kept_while_lost(published: Mapping[str, Device], problems: Sequence[GpuProblem],
                    index_attribute: str) -> tuple[list[Device], list[str]]:
    """The devices last published on GPUs NVML now reports lost, and a warning per such GPU.

    A GPU that fell off the bus is still in the machine and comes back with a reset; its health events have
    already marked its devices unhealthy (and tainted them). Left out of a discovery that happens meanwhile,
    they would leave the slices and stay away after the reset, which sends no hot-plug event to find them
    again; so they stay as they were last seen. `index_attribute` names the attribute holding the GPU's index.
    """
    lost = {p.index: p for p in problems if p.lost}
    kept = [d for d in published.values() if d.attributes.get(index_attribute) in lost]
    held = {d.attributes.get(index_attribute) for d in kept}
    warnings = [f"{lost[i].message.removesuffix('; left out')}; its devices stay published as last seen until it "
                "answers NVML again" for i in sorted(lost) if i in held]
    return kept, warnings
