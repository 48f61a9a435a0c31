"""The one way from the product to the simulator: a simulated node for `--simulate` (`run`, `discover`,
`backends`), and the demo.

Nothing else in `agent`, `backends` or `cdi` imports the `simulator` package, and this module imports it only
inside the function a command calls, so `dra-agent run` on a real node never loads a line of it. The simulator
needs the `simulator` extra (`pip install 'dra-agent[simulator]'`); without it these functions say so.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PROFILES", "SimulatedHost", "SimulatorError", "open_node", "reexec_under_preload", "run_demo",
           "udev_reaches"]

PROFILES = ("a2-highgpu-1g", "dgx-h100", "gke-g2-l4", "gke-n1-p4x4", "gke-n1-t4x2", "mixed", "tpu-v5e-8")
"""The simulator's built-in node profiles, named here so that `--help` lists them without loading the simulator
(tests/agent/commands/test_cli_errors.py checks they are the simulator's)."""


class SimulatorError(Exception):
    """The simulated node cannot be made as asked (unknown or invalid profile), or the simulator is missing."""


@dataclass(frozen=True)
class SimulatedHost:
    """Where a simulated node lies: its root (the host root of a real node), its sysfs and /dev trees."""

    root: Path
    sysfs: Path
    dev: Path
    profile: str


@contextmanager
def open_node(profile: str, root: Path | None, kernel_process: bool) -> Iterator[SimulatedHost]:
    """A simulated node built from `profile` (a built-in name or a YAML file), served for the duration of the
    block; kept at `root` when given. With `kernel_process` its kernel side runs in a process of its own, as a
    real kernel runs beside the agent rather than taking turns with it."""
    try:
        from simulator.node.node import simulated_node
        from simulator.node.profile import ProfileError
    except ImportError as e:
        raise SimulatorError(_missing(e)) from e
    with ExitStack() as stack:
        try:
            node = stack.enter_context(simulated_node(profile, root, kernel_process=kernel_process))
        except ProfileError as e:
            raise SimulatorError(str(e)) from e
        yield SimulatedHost(node.root, node.sysfs, node.dev, node.profile.name)


def reexec_under_preload(root: Path) -> str | None:
    """Re-execute this process under umockdev's preload for the node at `root`, so that its udev monitor sees
    the node's uevents. Returns None when it already runs so, or the reason it cannot; otherwise never returns."""
    try:
        from simulator.udev.preload import reexec_for
    except ImportError as e:
        return _missing(e)
    return reexec_for(root)


def udev_reaches(root: Path) -> bool:
    """Whether udev events of the simulated node at `root` reach this process (it runs under the preload)."""
    try:
        from simulator.udev.preload import active_for
    except ImportError:
        return False
    return active_for(root)


def run_demo(profile: str | None, scenarios: Sequence[str], color: bool | None, keep: Path | None) -> int:
    """`dra-agent demo`: the path of a claim on simulated nodes, told as it happens."""
    try:
        from simulator.demo.command import main
    except ImportError as e:
        print(f"dra-agent: {_missing(e)}")
        return 2
    return main(profile, list(scenarios), color=color, keep=keep)


def _missing(e: ImportError) -> str:
    return (f"the simulator is not installed ({e}): install dra-agent with its simulator extra, "
            "pip install 'dra-agent[simulator]'")
