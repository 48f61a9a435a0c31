"""The control channel of a simulated node's NVML: inject Xid and ECC events, lose and reset GPUs from outside.

A simulated node serves a unix datagram socket at `<root>/.sim/nvml.sock` from a daemon thread. Each request
is one JSON object in one datagram; the reply is one JSON object sent back to the sender's address:

    {"op": "xid", "gpu": "0", "xid": 79, "gi": 1, "ci": 0, "lost": null} → {"ok": true, "gpu": {…}, "delivered": 1}
    {"op": "ecc", "gpu": "GPU-…", "double_bit": true}                    → {"ok": true, "gpu": {…}, "delivered": 1}
    {"op": "lost", "gpu": "0000:18:00.0"}                                → {"ok": true, "gpu": {…}}
    {"op": "reset", "gpu": "0"}                                          → {"ok": true, "gpu": {…}}
    {"op": "list"}                                                       → {"ok": true, "gpus": [{…}, …]}
    {"op": "driver", "loaded": false}                                    → {"ok": true, "loaded": false}
    {"op": "counts"}                                                     → {"ok": true, "nvml": {…}, "drivers": {…}}
    {"op": "slow", "symbol": "nvmlDeviceCreateGpuInstanceWithPlacement", "seconds": 1.5}
                                                                         → {"ok": true, "symbol": …, "seconds": 1.5}
    anything wrong                                                       → {"ok": false, "error": "…"}

`counts` tells how often each NVML symbol was called (by any process) and each driver change the kernel made
(`"<bus id> bind <driver>"`, `"<bus id> unbind <driver>"`); `slow` makes every later call of an NVML symbol take
that long, as slow hardware does (a GPU instance takes its time to make). `gpu` names a GPU by NVML index, UUID
or PCI bus id; `gi`/`ci` are optional; `delivered` counts the event sets that received the event (0: nobody is
watching that GPU for that event type). The same operations are a CLI:
`python -m simulator.nvml.control --sim-root R xid 0 79`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from simulator.nvml.api import SimulatedNvml
from simulator.nvml.events import NO_INSTANCE
from simulator.timing import scaled

__all__ = ["ControlError", "ControlServer", "control_socket", "main", "request", "serve_control", "socket_address"]

_MAX_DATAGRAM = 1 << 16
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path minus the terminating NUL


class ControlError(Exception):
    """A control request failed: no node serving, or the node refused it (the message says why)."""


def control_socket(root: Path) -> Path:
    """Where the simulated node kept at `root` serves its control channel."""
    return root / ".sim" / "nvml.sock"


@contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """A connectable name for `path`; a path longer than sun_path is reached through its folder's descriptor."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


class ControlServer:
    """Serves one simulated NVML's control socket from a daemon thread (no polling: the thread sleeps in poll(2)
    on the socket and a wake-up pipe; not select(2), which cannot watch descriptors above 1023)."""

    def __init__(self, nvml: SimulatedNvml, path: Path,
                 driver_changes: Callable[[], dict[str, int]] = dict) -> None:
        self.nvml = nvml
        self.path = path
        self._driver_changes = driver_changes  # the kernel's count of driver binds and unbinds
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._inode = 0
        self._thread: threading.Thread | None = None

    def start(self) -> ControlServer:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            self.path.unlink()  # left by a process that was killed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            with socket_address(self.path) as address:
                sock.bind(address)
            self._inode = self.path.stat().st_ino
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="simulated-nvml-control", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None or self._sock is None:
            return
        os.write(self._wake_w, b"x")
        self._thread.join()
        self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        with suppress(FileNotFoundError):
            if self.path.stat().st_ino == self._inode:  # another process may serve this node by now
                self.path.unlink()
        self._thread = self._sock = None

    def _serve(self) -> None:
        assert self._sock is not None
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r in ready:
                return
            try:
                data, sender = self._sock.recvfrom(_MAX_DATAGRAM)
            except OSError:
                continue
            reply = self.handle(data)
            if sender:
                with suppress(OSError):  # the client gave up waiting
                    self._sock.sendto(json.dumps(reply).encode(), sender)

    def handle(self, data: bytes) -> dict[str, Any]:
        """The reply to one request datagram."""
        try:
            message = json.loads(data)
            if not isinstance(message, dict):
                raise ValueError("a request is a JSON object")
            return {"ok": True, **self._apply(message)}
        except (ValueError, KeyError, TypeError) as e:
            text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return {"ok": False, "error": str(text)}

    def _apply(self, message: Mapping[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        nvml = self.nvml
        if op == "list":
            return {"gpus": [self._describe(i) for i in range(len(nvml.gpus))]}
        if op == "counts":
            return {"nvml": nvml.call_counts(), "drivers": self._driver_changes()}
        if op == "slow":
            symbol, seconds = message.get("symbol"), message.get("seconds")
            if not isinstance(symbol, str) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 600:
                raise ValueError("op slow needs 'symbol' (an NVML C symbol) and 'seconds' (0 to 600)")
            nvml.durations[symbol] = float(seconds)
            return {"symbol": symbol, "seconds": float(seconds)}
        if op == "driver":
            loaded = message.get("loaded")
            if not isinstance(loaded, bool):
                raise ValueError("op driver needs 'loaded': true or false")
            nvml.set_driver_loaded(loaded)
            return {"loaded": loaded}
        if op not in ("xid", "ecc", "lost", "reset"):
            raise ValueError(f"unknown op {op!r}; expected one of xid, ecc, lost, reset, list, driver, counts, slow")
        ref = message.get("gpu")
        if not isinstance(ref, (str, int)) or isinstance(ref, bool):
            raise ValueError(f"op {op} needs 'gpu': an NVML index, a UUID or a PCI bus id")
        index = nvml.gpu_index(ref)
        result: dict[str, Any] = {}
        if op == "xid":
            xid = _integer(message, "xid", required=True)
            lost = message.get("lost")
            if lost is not None and not isinstance(lost, bool):
                raise ValueError("'lost' must be true, false or null")
            result["delivered"] = nvml.inject_xid(index, xid, _integer(message, "gi"), _integer(message, "ci"), lost)
        elif op == "ecc":
            double = message.get("double_bit", True)
            if not isinstance(double, bool):
                raise ValueError("'double_bit' must be true or false")
            result["delivered"] = nvml.inject_ecc(index, double)
        elif op == "lost":
            nvml.set_lost(index)
        else:
            nvml.reset_gpu(index)
        return {"gpu": self._describe(index), **result}

    def _describe(self, index: int) -> dict[str, Any]:
        gpu = self.nvml.gpus[index]
        return {"index": index, "uuid": gpu.uuid, "bus_id": gpu.bus_id, "lost": gpu.lost,
                "mig_enabled": gpu.mig_enabled, "registered_events": self.nvml.registrations(index)}


def _integer(message: Mapping[str, Any], key: str, required: bool = False) -> int:
    value = message.get(key)
    if value is None and not required:
        return NO_INSTANCE
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{key!r} must be an integer from 0 to 4294967295, got {value!r}")
    return value


@contextmanager
def serve_control(nvml: SimulatedNvml, root: Path) -> Iterator[ControlServer]:
    """Serve `nvml`'s control channel under `root` for the duration of the block."""
    server = ControlServer(nvml, control_socket(root)).start()
    try:
        yield server
    finally:
        server.stop()


def request(root: Path, message: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """Send one request to the simulated node kept at `root`; its reply, or ControlError."""
    timeout = scaled(5.0) if timeout is None else timeout
    path = control_socket(root)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.bind("")  # an automatic abstract address, so the node can answer
        sock.settimeout(timeout)
        try:
            with socket_address(path) as address:
                sock.sendto(json.dumps(message).encode(), address)
            data = sock.recv(_MAX_DATAGRAM)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            raise ControlError(f"no simulated node serves {path}: is `dra-agent run --simulate PROFILE "
                               f"--sim-root {root}` running?") from None
        except TimeoutError:
            raise ControlError(f"the simulated node at {root} did not answer within {timeout:g} s") from None
    reply = json.loads(data)
    if not isinstance(reply, dict) or not reply.get("ok"):
        raise ControlError(str(reply.get("error") if isinstance(reply, dict) else reply))
    return reply


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulator.nvml.control",
        description="Inject NVML events into a running simulated node (dra-agent run --simulate --sim-root R).",
    )
    parser.add_argument("--sim-root", type=Path, default=os.environ.get("DRA_AGENT_SIM_ROOT"),
                        help="the simulated node's folder (default: $DRA_AGENT_SIM_ROOT)")
    parser.add_argument("--json", action="store_true", help="print the node's reply as JSON")
    ops = parser.add_subparsers(dest="op", required=True)
    xid = ops.add_parser("xid", help="an Xid critical error (79 also takes the GPU off the bus)")
    xid.add_argument("gpu", help="NVML index, UUID or PCI bus id")
    xid.add_argument("xid", type=int)
    xid.add_argument("--gi", type=int, help="attribute it to this GPU instance")
    xid.add_argument("--ci", type=int, help="and this compute instance")
    xid.add_argument("--lost", action=argparse.BooleanOptionalAction, default=None,
                     help="whether the GPU falls off the bus (default: only for Xid 79)")
    ecc = ops.add_parser("ecc", help="a double-bit ECC error (--single-bit: a corrected one)")
    ecc.add_argument("gpu")
    ecc.add_argument("--single-bit", action="store_true")
    ops.add_parser("lost", help="the GPU falls off the bus").add_argument("gpu")
    ops.add_parser("reset", help="reset the GPU: back on the bus, healthy").add_argument("gpu")
    ops.add_parser("list", help="the node's GPUs")
    ops.add_parser("driver", help="load or unload the kernel module (unloaded: nvmlInit fails)").add_argument(
        "state", choices=("load", "unload"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """The CLI: 0 when the node did it, 1 when it refused or is not running, 2 for bad usage."""
    args = _parser().parse_args(argv)
    if args.sim_root is None:
        print("error: --sim-root (or DRA_AGENT_SIM_ROOT) is required", file=sys.stderr)
        return 2
    message: dict[str, Any] = {"op": args.op}
    if args.op == "driver":
        message["loaded"] = args.state == "load"
    elif args.op != "list":
        message["gpu"] = args.gpu
    if args.op == "xid":
        message.update(xid=args.xid, gi=args.gi, ci=args.ci, lost=args.lost)
    elif args.op == "ecc":
        message["double_bit"] = not args.single_bit
    try:
        reply = request(args.sim_root, message)
    except ControlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply, indent=2))
    elif args.op == "driver":
        print(f"the NVIDIA kernel module is {'loaded' if reply['loaded'] else 'unloaded'}")
    elif args.op == "list":
        for gpu in reply["gpus"]:
            state = "lost" if gpu["lost"] else "ok"
            print(f"{gpu['index']}  {gpu['uuid']}  {gpu['bus_id']}  {state}")
    else:
        gpu = reply["gpu"]
        extra = f", delivered to {reply['delivered']} event set(s)" if "delivered" in reply else ""
        print(f"{args.op} on GPU {gpu['index']} ({gpu['bus_id']}){extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
