"""What a container needs to use one MIG device: the parent GPU's device node and the two nvidia-caps nodes that
grant its GPU instance and compute instance, with minors from the driver's MIG capability table."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from backends.contract import PrepareError
from cdi.spec import ContainerEdits, DeviceNode

__all__ = ["MigEdits"]


class MigEdits:
    """Container edits of MIG devices on one host; reads the capability table once (it is fixed while the
    driver is loaded)."""

    def __init__(self, host_root: Path, node: Callable[[str], DeviceNode] = lambda name: DeviceNode(f"/dev/{name}")
                 ) -> None:
        """`node` makes the container's device node of a name below /dev (the driver's may be elsewhere on the
        host, see `NvidiaBackend.device_node`)."""
        self._table = host_root / "proc/driver/nvidia-caps/mig-minors"
        self._node = node
        self._lock = threading.Lock()
        self._minors: dict[str, int] | None = None

    def edits(self, gpu_minor: int, gpu_instance: int, compute_instance: int) -> ContainerEdits:
        minors = self._capability_minors()
        base = f"gpu{gpu_minor}/gi{gpu_instance}"
        nodes = [self._node(f"nvidia{gpu_minor}")]
        for key in (f"{base}/access", f"{base}/ci{compute_instance}/access"):
            minor = minors.get(key)
            if minor is None:
                raise PrepareError(f"the NVIDIA driver lists no MIG capability {key} ({self._table})")
            nodes.append(self._node(f"nvidia-caps/nvidia-cap{minor}"))
        return ContainerEdits(device_nodes=tuple(nodes))

    def _capability_minors(self) -> dict[str, int]:
        with self._lock:
            if self._minors is None:
                try:
                    lines = self._table.read_text().splitlines()
                except OSError as e:
                    raise PrepareError(f"cannot read the NVIDIA driver's MIG capabilities ({self._table}): "
                                       f"{e.strerror or e}") from None
                minors = {}
                for line in lines:  # "gpu0/gi1/ci0/access 13"
                    key, _, value = line.rpartition(" ")
                    if key and value.isdigit():
                        minors[key] = int(value)
                self._minors = minors
            return self._minors
