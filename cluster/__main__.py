"""`python -m cluster`: build the pinned components, or start a control plane on 127.0.0.1 and keep it up.

    python -m cluster build                 # build (or find cached) the binaries; print their folder
    python -m cluster up [--dir D] [--node NAME] [--deploy]
                                            # etcd, kube-apiserver, kube-controller-manager, kube-scheduler;
                                            # the node registered; deploy/ applied; Ctrl-C stops everything
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from cluster import HERE, binaries, build
from cluster.controlplane import ComponentFailed, ControlPlane
from cluster.kubectl import Kubectl
from cluster.node import register_node

DEFAULT_NODE = "127.0.0.1"


def _up(args: argparse.Namespace) -> int:
    folder = binaries()
    if folder is None:
        print("the cluster's binaries are not built: run `python -m cluster build` (cluster/build.sh)",
              file=sys.stderr)
        return 2
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dra-cluster-"))
    plane = ControlPlane(work, folder, verbosity=args.v)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        plane.start()
        kubectl = Kubectl(folder / "kubectl", plane.admin_kubeconfig)
        register_node(kubectl, args.node)
        if args.deploy:
            print(kubectl.run("apply", "--server-side", "-k", str(HERE.parent / "deploy")), end="")
        print(f"control plane ready at {plane.server}; node {args.node} registered")
        print(f"export KUBECONFIG={plane.admin_kubeconfig} PATH={folder}:$PATH")
        print(f"logs in {work / 'logs'}; Ctrl-C stops everything", flush=True)
        while not stop.wait(1.0):
            plane.check_alive()
    except KeyboardInterrupt:
        pass
    except ComponentFailed as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        plane.stop(keep=args.dir is not None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the pinned components into the cache and print their folder")
    up = commands.add_parser("up", help="start a control plane on 127.0.0.1 until Ctrl-C")
    up.add_argument("--dir", help="keep the cluster's files here (default: a new temporary folder, removed after)")
    up.add_argument("--node", default=DEFAULT_NODE, help=f"the node to register (default {DEFAULT_NODE})")
    up.add_argument("--deploy", action="store_true", help="apply deploy/ (kubectl apply --server-side -k)")
    up.add_argument("-v", type=int, default=1, metavar="N", help="the components' log verbosity (default 1)")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(*build(), sep="\n")
        return 0
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
