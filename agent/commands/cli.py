"""The `dra-agent` command line: parses flags, resolves settings, sets up logging, runs a command."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TextIO

from agent import __version__
from agent.logs import configure_logging, get_logger
from agent.node.simulated import PROFILES
from agent.settings import ENV_PREFIX, Settings, SettingsError, resolve_settings, unknown_environment

__all__ = ["build_parser", "main"]

Command = Callable[[Settings, str, TextIO, TextIO], Coroutine[Any, Any, int]]

# Flags that map one-to-one onto settings (argparse dest == setting name).
_SETTING_FLAGS = (
    "node_name", "log_level", "log_format", "simulate", "sim_root", "sysfs_root", "dev_root", "host_root",
    "driver_root", "backends", "kubeconfig", "registry_dir", "plugins_dir", "cdi_dir", "cdi_host_root", "state_dir",
    "pod_uid", "metrics_address", "health_timeout", "no_execute", "reap_interval", "reap_grace", "host_netns",
    "claim_status", "device_metadata", "allowed_configs",
)


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("settings (also DRA_AGENT_<NAME> environment variables or --config)")
    group.add_argument("--config", metavar="FILE", help=f"YAML settings file (env {ENV_PREFIX}CONFIG)")
    group.add_argument("--node-name", dest="node_name", metavar="NAME",
                       help="Kubernetes node name (env NODE_NAME; default: profile name when simulating, "
                            "else the host name)")
    group.add_argument("--simulate", metavar="PROFILE",
                       help="run on a simulated node: a profile YAML file or a built-in profile: "
                            + ", ".join(PROFILES))
    group.add_argument("--sim-root", dest="sim_root", type=Path, metavar="DIR",
                       help="keep the simulated node in DIR and reuse it on later runs (default: temporary)")
    group.add_argument("--sysfs-root", dest="sysfs_root", type=Path, metavar="DIR", help="sysfs root (/sys)")
    group.add_argument("--dev-root", dest="dev_root", type=Path, metavar="DIR", help="device node root (/dev)")
    group.add_argument("--host-root", dest="host_root", type=Path, metavar="DIR",
                       help="where the host's file system is seen (/)")
    group.add_argument("--driver-root", dest="driver_root", type=Path, metavar="DIR",
                       help="where the GPU driver's libraries and binaries are seen, below --host-root (default: "
                            "the host root; <host root>/run/nvidia/driver for the GPU operator's driver container)")
    group.add_argument("--backends", metavar="NAMES",
                       type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
                       help="comma-separated backends to enable (default: every installed backend)")
    group.add_argument("--log-level", dest="log_level", choices=("debug", "info", "warning", "error"))
    group.add_argument("--log-format", dest="log_format", choices=("auto", "json", "console"),
                       help="auto: JSON unless logging to a terminal")
    return common


def build_parser() -> argparse.ArgumentParser:
    from agent.commands.handlers import backends_command, check_command, discover_command, run_command

    parser = argparse.ArgumentParser(
        prog="dra-agent",
        description="Node-local Kubernetes DRA agent for NVIDIA GPUs, MIG partitions, Google TPUs and SR-IOV NICs.",
    )
    parser.add_argument("--version", action="version", version=f"dra-agent {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options()

    discover = commands.add_parser(
        "discover", parents=[common], help="print the ResourceSlices this node would publish",
        description="Discover the node's devices and print the exact ResourceSlice objects the agent would "
                    "publish, for every driver, chunked within the API limits.",
    )
    discover.add_argument("-o", "--output", choices=("yaml", "json", "table"), default="yaml")
    discover.set_defaults(handler=discover_command, command_parser=discover)

    backends = commands.add_parser(
        "backends", parents=[common], help="list installed backends and what they found",
        description="List the backends installed through the dra_agent.backends entry-point group, with "
                    "version, DRA driver name and whether each found hardware on this node.",
    )
    backends.add_argument("-o", "--output", choices=("table", "json"), default="table")
    backends.add_argument("--check", dest="handler", action="store_const", const=check_command,
                          help="run the conformance kit's static checks on each enabled backend (contract, typed "
                               "settings, discovery passes the API server's rules, stable names); exit 1 if one fails")
    backends.set_defaults(handler=backends_command, command_parser=backends)

    run = commands.add_parser(
        "run", parents=[common], help="run the node agent",
        description="Serve the kubelet's DRA and registration sockets for every driver with devices on this "
                    "node, prepare and unprepare claims, and publish the node's ResourceSlices.",
    )
    group = run.add_argument_group("agent")
    group.add_argument("--kubeconfig", type=Path, metavar="FILE",
                       help="kubeconfig (default: in-cluster credentials, else $KUBECONFIG or ~/.kube/config)")
    group.add_argument("--registry-dir", dest="registry_dir", type=Path, metavar="DIR",
                       help="kubelet plugin registration directory (/var/lib/kubelet/plugins_registry)")
    group.add_argument("--plugins-dir", dest="plugins_dir", type=Path, metavar="DIR",
                       help="kubelet plugins directory (/var/lib/kubelet/plugins)")
    group.add_argument("--cdi-dir", dest="cdi_dir", type=Path, metavar="DIR", help="CDI spec directory (/var/run/cdi)")
    group.add_argument("--cdi-host-root", dest="cdi_host_root", type=Path, metavar="DIR",
                       help="where the container runtime sees the host root; claims' CDI specs name host paths "
                            "below it (/; a simulated node's root when this machine's runtime runs its pods)")
    group.add_argument("--state-dir", dest="state_dir", type=Path, metavar="DIR",
                       help="checkpoint directory (/var/lib/dra-agent)")
    group.add_argument("--pod-uid", dest="pod_uid", metavar="UID",
                       help="this agent pod's UID, for seamless DaemonSet rolling updates")
    group.add_argument("--metrics-address", dest="metrics_address", metavar="HOST:PORT",
                       help="serve /metrics, /healthz and /readyz here")
    group.add_argument("--health-timeout", dest="health_timeout", type=int, metavar="SECONDS",
                       help="seconds before the kubelet reads a device's health as Unknown (30); its health is "
                            "re-sent every half of it")
    group.add_argument("--no-execute", dest="no_execute", metavar="CAUSES",
                       type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
                       help="health causes whose device taint evicts pods (NoExecute), e.g. gpu-lost,xid; "
                            "others taint NoSchedule")
    group.add_argument("--reap-interval", dest="reap_interval", type=float, metavar="SECONDS",
                       help="seconds between checks of the prepared claims against the API server (600); a claim "
                            "whose ResourceClaim is gone or no longer allocated here is unprepared")
    group.add_argument("--reap-grace", dest="reap_grace", type=float, metavar="SECONDS",
                       help="seconds a prepared claim must have been gone before it is unprepared (300)")
    group.add_argument("--claim-status", dest="claim_status", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="write each prepared device's entry in its claim's status.devices and remove it at "
                            "unprepare (default: on)")
    group.add_argument("--host-netns", dest="host_netns", metavar="auto|off|FILE",
                       help="network namespace for link and uevent sockets: auto (the host's, entered from a pod "
                            "of its own), off (the agent's), or a namespace file")
    group.add_argument("--device-metadata", dest="device_metadata", action=argparse.BooleanOptionalAction,
                       default=None, help="give containers a device metadata file per claim request (KEP-5304), "
                                          "mounted through CDI; needs a kubelet of Kubernetes 1.34 or later (off)")
    group.add_argument("--allowed-configs", dest="allowed_configs", metavar="NAMES",
                       type=lambda text: tuple(n.strip() for n in text.split(",") if n.strip()),
                       help="reconfigurations claims may ask for on this node, comma-separated, e.g. "
                            "VfioConfig,GpuConfig.sharing.TimeSlicing,VfConfig.netDevice (default: none)")
    run.set_defaults(handler=run_command, output=None, command_parser=run)

    demo = commands.add_parser(
        "demo", help="show the path of a claim on simulated nodes, end to end",
        description="Start a test API server, dra-agent on simulated nodes, a kubelet simulator and a small "
                    "allocator, and run scenarios that show a claim's whole path: published devices, allocation "
                    "and why, prepare and its CDI spec, a device failure, unprepare. Exit 0 only if every step "
                    "behaved.",
    )
    demo.add_argument("--profile", metavar="PROFILE",
                      help="node profile of the main node, a YAML file or a built-in profile: "
                           f"{', '.join(PROFILES)}; alone, a tour of its devices")
    demo.add_argument("--scenario", dest="scenarios", action="append", default=[], metavar="NAME",
                      help="run this scenario (repeatable): readiness, all-gpus, aligned-nic, mig, vfio, health, "
                           "extended-gpu, claim-status, vm-metadata, gpu-shares, vf-interface, tour "
                           "(default: all but tour)")
    demo.add_argument("--keep", type=Path, metavar="DIR", help="keep the nodes' files (agent logs, CDI specs) here")
    demo.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour (auto: on a TTY)")
    demo.set_defaults(command_parser=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # what is still buffered goes now, while a reader that left can still be told apart
        return code
    except BrokenPipeError:
        # The reader went away (`dra-agent discover | head`): stop quietly, with the status a shell gives a command
        # that SIGPIPE stopped. Python's own recipe: stdout to /dev/null, so that its flush at exit fails no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: Sequence[str] | None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would blame the top-level command and print its usage
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "demo":
        from agent.node.simulated import run_demo

        color = {"auto": None, "always": True, "never": False}[args.color]
        return run_demo(args.profile, args.scenarios, color=color, keep=args.keep)
    flags = {key: getattr(args, key, None) for key in _SETTING_FLAGS}
    config = args.config or os.environ.get(f"{ENV_PREFIX}CONFIG")
    try:
        settings, origins = resolve_settings(flags, os.environ, Path(config) if config else None)
    except SettingsError as e:
        print(f"dra-agent: {e}", file=sys.stderr)
        return 2
    from agent.node.plugins import unknown_backends  # package metadata only: no backend is imported

    problem = unknown_backends(settings.backends)
    if problem:
        print(f"dra-agent: {problem}", file=sys.stderr)
        return 2
    from agent.node.plugin_settings import plugin_settings_problems  # loads backends only when there is a check

    problems = plugin_settings_problems(settings, origins)
    if problems:
        print("dra-agent: invalid settings:\n" + "\n".join(problems), file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    for variable, close in unknown_environment(os.environ):
        get_logger("settings").warning("environment variable ignored: no setting has this name",
                                       variable=variable, did_you_mean=close)
    handler: Command = args.handler
    try:
        return asyncio.run(handler(settings, args.output, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        raise  # not a bug: the reader went away (see main)
    except Exception:
        # A bug, not bad input: say so in one line; where it happened is in the log at debug level.
        get_logger("cli").debug("internal error", exc_info=True)
        print("dra-agent: internal error: this is a bug in dra-agent; rerun with --log-level debug to log where it "
              "happened", file=sys.stderr)
        return 1
