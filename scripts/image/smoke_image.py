"""Smoke test of a built dra-agent image: runs it with rootful podman as the DaemonSet runs it on a node.

    python scripts/image/smoke_image.py [--runtime NAME] [--ulimit SPEC]... IMAGE
        (as root, with the checkout's simulator importable; --runtime and --ulimit go to every podman run, for
        machines where podman's defaults cannot run a container: see docs/deploy.md)

1. `dra-agent --version` in the image.
2. `dra-agent discover --simulate dgx-h100` in the product image: refused, naming the simulator extra (the image
   ships the product alone); then the same command in a test container with the checkout's `simulator/` mounted
   read-only on PYTHONPATH, the simulated NVML library prebuilt on this machine mounted as its cache (the image has
   no C compiler, and needs none).
3. A simulated dgx-h100 node laid out on this machine (its kernel side, among it the NVML server, served from this
   process), mounted read-only at /host; the kubelet's directories, the CDI and state directories mounted at their
   paths as the DaemonSet mounts them; a read-only root file system and a tmpfs /tmp; a test API server on this
   machine's loopback (the container shares the host's network). Then `dra-agent discover` against /host without
   the simulator: the image's own libraries (libudev through pyudev, NVML loaded from the driver root) find the
   devices. Then `dra-agent run` with the DaemonSet's arguments (and the sysfs and /dev of the simulated node: the
   DaemonSet mounts the real ones at /sys and /dev): it must register with the kubelet's directory, publish its
   ResourceSlices to the API server and answer /readyz, then exit 0 within the grace period on SIGTERM. The
   simulated host's procfs has no namespace files: the agent warns that /host/proc/1/ns/net cannot be read and
   opens its link and uevent sockets in the container's namespace, which is this machine's (--network=host).

Prints each command and what it printed (trimmed): docs/deploy.md quotes the transcript. Exit status 0 when every
step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

from simulator.apiserver.server import TestApiServer
from simulator.node.node import simulated_node
from simulator.nvml.library import build_library

PROFILE = "dgx-h100"
NODE = "smoke-node"
REPO = Path(__file__).resolve().parents[2]
# The DaemonSet's terminationGracePeriodSeconds: the agent must be gone by then.
GRACE_SECONDS = 15
READY_SECONDS = 60


class SmokeFailure(Exception):
    """A step of the smoke test did not do what the product must."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def trimmed(text: str, keep: int = 12) -> str:
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= keep:
        return "\n".join(lines)
    return "\n".join([*lines[: keep // 2], f"... ({len(lines) - keep} lines)", *lines[-keep // 2 :]])


# Global options of every podman command, and options of every `podman run` (from the command line).
PODMAN: list[str] = []
RUN: list[str] = []


async def podman(*args: str, expect: int | None = 0, keep: int = 12, quiet: bool = False) -> tuple[int, str]:
    """Run `podman ARGS`, print the command and its output (trimmed) unless `quiet`, check the exit status."""
    command = [*PODMAN, args[0], *(RUN if args[0] == "run" else []), *args[1:]]
    if not quiet:
        print("$ podman " + shlex.join(command), flush=True)
    process = await asyncio.create_subprocess_exec(
        "podman", *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await process.communicate()
    text = out.decode(errors="replace")
    code = process.returncode
    assert code is not None
    if not quiet:
        if text.strip():
            print(trimmed(text, keep), flush=True)
        print(f"[exit {code}]", flush=True)
    if expect is not None and code != expect:
        raise SmokeFailure(f"podman {args[0]} exited {code}, expected {expect}")
    return code, text


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


async def smoke(image: str, work: Path) -> None:
    await podman("run", "--rm", image, "--version")

    # The product image has no simulator: --simulate must say what is missing, not crash on an import.
    code, text = await podman("run", "--rm", image, "discover", "--simulate", PROFILE, "-o", "table", expect=None)
    if code == 0 or "simulator" not in text:
        raise SmokeFailure("discover --simulate in the product image should refuse, naming the simulator")
    nvml_cache = build_library().parent  # the library the simulated node loads, built here with this machine's cc
    # The simulated node goes to XDG_RUNTIME_DIR: a tmpfs that allows loading its NVML library (podman mounts
    # /dev/shm and its tmpfs noexec by default).
    await podman("run", "--rm", "--read-only", "--tmpfs", "/run/sim:rw,exec", "-e", "XDG_RUNTIME_DIR=/run/sim",
                 "-v", f"{REPO / 'simulator'}:/opt/test/simulator:ro", "-e", "PYTHONPATH=/opt/test",
                 "-v", f"{nvml_cache}:/root/.cache/dra-agent/simulated-nvml:ro",
                 image, "discover", "--simulate", PROFILE, "-o", "table", keep=16)

    host = work / "host"
    kubelet, cdi, state = work / "kubelet", work / "cdi", work / "state"
    for folder in (kubelet / "plugins_registry", kubelet / "plugins", cdi, state):
        folder.mkdir(parents=True)
    with simulated_node(PROFILE, host):
        async with TestApiServer() as server:
            server.add_node(NODE)
            kubeconfig = server.write_kubeconfig(work / "kubeconfig")
            mounts = [
                "-v", f"{host}:/host:ro",
                "-v", f"{kubelet / 'plugins_registry'}:/var/lib/kubelet/plugins_registry",
                "-v", f"{kubelet / 'plugins'}:/var/lib/kubelet/plugins",
                "-v", f"{cdi}:/var/run/cdi",
                "-v", f"{state}:/var/lib/dra-agent",
                "-v", f"{kubeconfig}:/etc/dra-agent/kubeconfig:ro",
                "--tmpfs", "/tmp",
            ]
            # The simulated node's sysfs and /dev below /host: the DaemonSet mounts the real ones at /sys and /dev.
            node_flags = ["--host-root=/host", "--driver-root=/host", "--sysfs-root=/host/sys",
                          "--dev-root=/host/dev"]
            container = ["--privileged", "--read-only", "--network=host", *mounts]
            _, table = await podman("run", "--rm", *container, image, "discover", f"--node-name={NODE}",
                                    *node_flags, "-o", "table", keep=16)
            if "gpu.nvidia.com" not in table:
                raise SmokeFailure("discover against /host found no NVIDIA GPU")

            port = free_port()
            name = f"dra-agent-smoke-{uuid.uuid4().hex[:8]}"
            await podman("run", "--detach", "--name", name, *container, image, "run", f"--node-name={NODE}",
                         f"--pod-uid={uuid.uuid4()}", f"--metrics-address=127.0.0.1:{port}", *node_flags,
                         "--log-format=json", "--kubeconfig=/etc/dra-agent/kubeconfig")
            try:
                await _until_ready(server, port, name)
                registered = sorted(p.name for p in (kubelet / "plugins_registry").iterdir())
                print(f"registration sockets: {', '.join(registered)}")
                slices = server.objects("resourceslices")
                per_driver = Counter(s["spec"]["driver"] for s in slices)
                devices: Counter[str] = Counter()
                for s in slices:
                    devices[s["spec"]["driver"]] += len(s["spec"].get("devices", []))
                counts = ", ".join(f"{d}: {n} slice(s), {devices[d]} device(s)" for d, n in sorted(per_driver.items()))
                print(f"ResourceSlices on the API server: {len(slices)} ({counts})")
                if not slices or not registered:
                    raise SmokeFailure("the agent is ready but published or registered nothing")
                if any(s["spec"].get("nodeName") != NODE for s in slices):
                    raise SmokeFailure("a ResourceSlice is not for the agent's node")
                began = time.monotonic()
                await podman("kill", "--signal", "TERM", name)
                _, status = await podman("wait", name)
                stopped = time.monotonic() - began
                exit_code = int(status.strip())
                print(f"stopped {stopped:.1f} s after SIGTERM, exit status {exit_code}")
                await podman("logs", name, keep=10)
                if exit_code != 0:
                    raise SmokeFailure(f"the agent exited {exit_code} on SIGTERM")
                if stopped > GRACE_SECONDS:
                    raise SmokeFailure(f"the agent took {stopped:.1f} s to stop, longer than the grace period")
                left = sorted(p.name for p in (kubelet / "plugins_registry").iterdir())
                print(f"registration sockets left: {', '.join(left) or 'none'}")
            finally:
                await podman("rm", "--force", "--ignore", name, expect=None, quiet=True)


async def _until_ready(server: TestApiServer, port: int, name: str) -> None:
    deadline = time.monotonic() + READY_SECONDS
    began = time.monotonic()
    while http_status(f"http://127.0.0.1:{port}/readyz") != 200:
        _, running = await podman("inspect", "--format", "{{.State.Running}}", name, quiet=True)
        if running.strip() != "true":
            await podman("logs", name, expect=None, keep=30)
            raise SmokeFailure("the agent exited before it was ready")
        if time.monotonic() > deadline:
            await podman("logs", name, expect=None, keep=30)
            raise SmokeFailure(f"not ready within {READY_SECONDS} s")
        await asyncio.sleep(0.25)
    print(f"/readyz 200 after {time.monotonic() - began:.1f} s; "
          f"/healthz {http_status(f'http://127.0.0.1:{port}/healthz')}")
    del server


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="smoke_image.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image")
    parser.add_argument("--runtime", help="the OCI runtime podman uses (podman --runtime)")
    parser.add_argument("--ulimit", action="append", default=[], help="podman run --ulimit (repeatable)")
    args = parser.parse_args(argv)
    if args.runtime:
        PODMAN.extend(["--runtime", args.runtime])
    RUN.extend(f"--ulimit={spec}" for spec in args.ulimit)
    with tempfile.TemporaryDirectory(prefix="dra-agent-smoke-", dir="/var/tmp") as work:
        try:
            asyncio.run(smoke(args.image, Path(work)))
        except SmokeFailure as e:
            print(f"smoke test FAILED: {e}", file=sys.stderr)
            return 1
    print("smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
