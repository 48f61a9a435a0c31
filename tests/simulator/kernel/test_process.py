"""The simulated kernel in a process of its own (as `dra-agent run` on a simulated node has it): it reacts to the
writes of the process that opened the node, and it never outlives that process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest

from backends.nvidia.driver_root import DriverRoot
from backends.nvidia.nvml import nvml_session, use_driver_root
from backends.vfio_sysfs import VFIO_PCI, Deadline, Rebinder
from simulator.kernel.process import KernelProcess, KernelProcessError
from simulator.node.node import simulated_node
from simulator.node.profile import load_profile
from tests.support.repository import ROOT
from tests.support.timing import scaled

GPU_BDF = "0000:18:00.0"


def driver(sysfs: Path, bus_id: str) -> str:
    return os.path.basename(os.readlink(sysfs / "bus/pci/devices" / bus_id / "driver"))


def test_the_kernel_process_reacts_to_writes_as_the_thread_does(scratch: Path) -> None:
    with simulated_node("dgx-h100", scratch / "node", kernel_process=True) as node:
        assert not any(t.name.startswith("simulated-kernel") for t in threading.enumerate())
        rebinder = Rebinder(node.sysfs)
        rebinder.to_vfio(GPU_BDF, Deadline(scaled(10)))
        assert driver(node.sysfs, GPU_BDF) == VFIO_PCI
        group = os.path.basename(os.readlink(node.sysfs / "bus/pci/devices" / GPU_BDF / "iommu_group"))
        assert (node.dev / "vfio" / group).exists()
        use_driver_root(DriverRoot(node.root, node.driver_root, node.dev))
        with nvml_session():  # the node's library: its calls are served by the kernel process
            assert pynvml.nvmlDeviceGetCount() == 7, "NVML in this process sees what the kernel process did"
        rebinder.back_to(GPU_BDF, "nvidia", Deadline(scaled(10)))
        assert driver(node.sysfs, GPU_BDF) == "nvidia"


def test_the_kernel_process_ends_with_the_process_that_started_it(scratch: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from simulator.node.node import simulated_node\n"
        "from simulator.kernel import process as kernel_process\n"
        "started = []\n"
        "real = kernel_process.KernelProcess.start\n"
        "def start(self):\n"
        "    started.append(real(self))\n"
        "    return started[-1]\n"
        "kernel_process.KernelProcess.start = start\n"
        "with simulated_node('gke-n1-t4x2', Path(sys.argv[1]), kernel_process=True):\n"
        "    print(started[0]._process.pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(scratch / "node")], stdout=subprocess.PIPE,
                              cwd=ROOT)
    try:
        assert parent.stdout is not None
        kernel = int(parent.stdout.readline())
        assert _alive(kernel)
        parent.send_signal(signal.SIGKILL)  # no clean-up of any kind
        parent.wait()
        deadline = time.monotonic() + scaled(10)
        while _alive(kernel):
            assert time.monotonic() < deadline, "the kernel process outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def test_a_kernel_process_that_cannot_start_is_reported(scratch: Path) -> None:
    with pytest.raises(KernelProcessError, match="failed to start"):
        KernelProcess(scratch / "no-such-node", load_profile("gke-n1-t4x2")).start()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_second_opener_attaches_and_the_kernel_lives_while_anyone_is_attached(scratch: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from simulator.kernel import process as kernel_process\n"
        "from simulator.node.node import simulated_node\n"
        "started = []\n"
        "real = kernel_process.KernelProcess.start\n"
        "def start(self):\n"
        "    started.append(real(self))\n"
        "    return started[-1]\n"
        "kernel_process.KernelProcess.start = start\n"
        "with simulated_node('dgx-h100', Path(sys.argv[1]), kernel_process=True):\n"
        "    print(started[0].pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    root = scratch / "node"
    with subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE,
                          cwd=ROOT) as starter:
        try:
            assert starter.stdout is not None
            kernel = int(starter.stdout.readline())
            with simulated_node("dgx-h100", root) as node:
                assert node.served_elsewhere
                assert not any(t.name.startswith("simulated-kernel") for t in threading.enumerate())
                with pytest.raises(RuntimeError, match="served by another process"):
                    node.nvml  # noqa: B018 - the GPU state lives in the kernel process
                starter.send_signal(signal.SIGKILL)
                starter.wait()
                time.sleep(scaled(0.5))  # a window in which the kernel must not end
                assert _alive(kernel), "this process is attached: the kernel serves it on"
                use_driver_root(DriverRoot(node.root, node.driver_root, node.dev))
                with nvml_session():
                    assert pynvml.nvmlDeviceGetCount() == 8
                rebinder = Rebinder(node.sysfs)
                rebinder.to_vfio(GPU_BDF, Deadline(scaled(10)))
                assert driver(node.sysfs, GPU_BDF) == VFIO_PCI
                rebinder.back_to(GPU_BDF, "nvidia", Deadline(scaled(10)))
            deadline = time.monotonic() + scaled(10)
            while _alive(kernel):
                assert time.monotonic() < deadline, "the kernel outlived the last process attached to it"
                time.sleep(0.05)
        finally:
            starter.kill()


def test_a_kernel_whose_node_was_removed_ends_without_making_it_again(scratch: Path) -> None:
    import shutil

    root = scratch / "node"
    with simulated_node("gke-n1-t4x2", root, kernel_process=True):
        shutil.rmtree(root)  # a test's scratch folder removed while the kernel still runs
    assert not root.exists()
