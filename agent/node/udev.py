"""The process's one udev monitor: uevents read on the event loop and handed to the backends that subscribed.

    udev = open_udev_monitor(host)          # None, after a warning, where udev cannot be watched
    if udev is not None:
        udev.start()                        # on the running loop; events queue in the socket until then
        ...                                 # BackendContext(..., udev=udev); backends call udev.subscribe()
        udev.close()

Source "kernel" (the default) receives the kernel's own uevents; they arrive before udevd has run its rules,
which the backends do not need (they read sysfs). Source "udev" receives the events udevd re-sends after its
rules, only where udevd runs. Which events a netlink socket hears depends on the network namespace it was
created in: the kernel sends most uevents (PCI functions, accel and vfio devices) to every namespace of the
host's user namespace, but a network device's only to the namespace the device is in, and udevd's only to its
own, the host's. So the monitor is opened in the host's network namespace (agent/node/host_netns.py): a pod with a
namespace of its own then hears the host's interfaces come and go, as the agent under systemd does. See
docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from agent.logs import get_logger
from agent.node import simulated
from agent.node.host import Host
from agent.node.host_netns import NetnsError, in_netns

if TYPE_CHECKING:
    import pyudev

__all__ = ["DEFAULT_SOURCE", "Handler", "Source", "UdevMonitor", "open_udev_monitor"]

Source = Literal["kernel", "udev"]
DEFAULT_SOURCE: Source = "kernel"
Handler = Callable[["pyudev.Device"], None]

# udevd asks for 128 MiB; a burst of hot-plug events (a PF with 64 VFs going away) must not overflow the
# socket while the loop is busy. Raising the limit needs CAP_NET_ADMIN; without it the default stays.
_RECEIVE_BUFFER = 16 * 1024 * 1024


class UdevMonitor:
    """A pyudev netlink monitor read on the asyncio loop; implements `backends.contract.DeviceEvents`."""

    def __init__(self, monitor: pyudev.Monitor, source: Source = DEFAULT_SOURCE) -> None:
        self.source = source
        self._monitor: pyudev.Monitor | None = monitor
        self._handlers: dict[str, list[Handler]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log = get_logger("udev").bind(source=source)

    def subscribe(self, subsystem: str, handler: Handler) -> Callable[[], None]:
        """Call `handler(device)` on the loop for every event of `subsystem`; the returned function unsubscribes."""
        if subsystem not in self._handlers and self._monitor is not None:
            # The monitor's socket filter then drops other subsystems in the kernel.
            self._monitor.filter_by(subsystem)
        handlers = self._handlers.setdefault(subsystem, [])
        handlers.append(handler)

        def unsubscribe() -> None:
            if handler in handlers:
                handlers.remove(handler)

        return unsubscribe

    def start(self) -> None:
        """Read events on the running loop from now on."""
        if self._monitor is None:
            raise RuntimeError("udev monitor used after close()")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._monitor.fileno(), self._drain)

    def close(self) -> None:
        """Stop reading and close the netlink socket; subscribers hear nothing more."""
        if self._monitor is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._monitor.fileno())
        self._loop = None
        self._handlers.clear()
        # pyudev closes the socket when the monitor is released; nothing else holds it.
        self._monitor = None

    def _drain(self) -> None:
        """Every event the socket holds now, each to its subsystem's handlers."""
        while self._monitor is not None:
            try:
                device = self._monitor.poll(timeout=0)
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self._log.warning("udev events were lost: the receive buffer overflowed")
                    continue
                self._log.warning("cannot read a udev event", error=str(e))
                return
            if device is None:
                return
            self._dispatch(device)

    def _dispatch(self, device: pyudev.Device) -> None:
        subsystem = device.subsystem
        self._log.debug("uevent", action=device.action, subsystem=subsystem, device=device.sys_name)
        for handler in list(self._handlers.get(subsystem, ())):
            try:
                handler(device)
            except Exception as e:  # one subscriber's bug must not starve the others
                self._log.error("udev event handler failed", action=device.action, subsystem=subsystem,
                                device=device.sys_name, error=f"{type(e).__name__}: {e}", exc_info=True)


def open_udev_monitor(host: Host, source: Source = DEFAULT_SOURCE, netns: Path | None = None) -> UdevMonitor | None:
    """The node's udev monitor, opened in the network namespace whose file is `netns` (this process's when
    None), receiving already (not yet read: call `start()` on the loop).

    None, after a warning, where udev cannot be watched: no libudev, no netlink socket (sandboxes, user
    namespaces), or a simulated node this process does not see through umockdev; the agent then runs without
    hot-plug: devices that appear or disappear are noticed at the next start. Where `netns` cannot be entered, a
    warning says so and the monitor is opened in this process's namespace instead.
    """
    log = get_logger("udev")
    if host.profile is not None and not simulated.udev_reaches(host.host_root):
        log.warning("no udev events on this simulated node: they need umockdev's preload "
                    "(`dra-agent run --simulate --sim-root DIR` re-executes under it when umockdev is installed)",
                    sim_root=str(host.host_root))
        return None
    try:
        import pyudev

        def open_monitor() -> pyudev.Monitor:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=source)
            monitor.start()  # binds the socket: from here on, events queue in it
            return monitor

        try:
            monitor = in_netns(netns, open_monitor)
        except NetnsError as e:
            log.warning("the host's network devices coming, going or being renamed will not be seen (PCI and other "
                        "devices' events still arrive): cannot enter the host's network namespace", error=str(e))
            monitor = open_monitor()
    except (ImportError, OSError) as e:
        log.warning("no udev events: cannot watch udev; devices that appear or disappear are noticed at the "
                    "next start", source=source, error=f"{type(e).__name__}: {e}")
        return None
    try:
        monitor.set_receive_buffer_size(_RECEIVE_BUFFER)
    except OSError as e:
        log.debug("udev receive buffer left at the default", error=str(e))
    return UdevMonitor(monitor, source)
