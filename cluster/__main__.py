"""`python -m cluster`: build the pinned components, or start a control plane on 127.0.0.1 and keep it up.

    python -m cluster build                 # build (or find cached) the binaries; print their folder
    python -m cluster agent-image           # build (or find cached) the agent's image as an OCI archive
    python -m cluster up [--dir D] [--node NAME] [--deploy] [--kubelet]
                                            # etcd, kube-apiserver, kube-controller-manager, kube-scheduler;
                                            # the node registered (--kubelet: containerd and the kubelet run it);
                                            # deploy/ applied; Ctrl-C stops everything
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from cluster import HERE, agent_image, binaries, build
from cluster.controlplane import ComponentFailed, ControlPlane
from cluster.incluster import apply_deploy
from cluster.kubectl import Kubectl
from cluster.node import register_node
from cluster.worker import WorkerNode

DEFAULT_NODE = "127.0.0.1"


def _up(args: argparse.Namespace) -> int:
    folder = binaries()
    if folder is None:
        print("the cluster's binaries are not built: run `python -m cluster build` (cluster/build.sh)",
              file=sys.stderr)
        return 2
    node_folder = binaries("node") if args.kubelet else None
    if args.kubelet and node_folder is None:
        print("the node's binaries are not built: run `python -m cluster build` (cluster/build.sh)", file=sys.stderr)
        return 2
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dra-cluster-"))
    plane = ControlPlane(work, folder, with_kubelet=args.kubelet, node_name=args.node, verbosity=args.v)
    worker = WorkerNode(plane, node_folder) if node_folder is not None else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        plane.start()
        kubectl = Kubectl(folder / "kubectl", plane.admin_kubeconfig)
        if worker is not None:
            worker.start()
        else:
            register_node(kubectl, args.node)
        if args.deploy and worker is not None:
            apply_deploy(kubectl, HERE.parent / "deploy")
        elif args.deploy:
            print(kubectl.run("apply", "--server-side", "-k", str(HERE.parent / "deploy")), end="")
        how = "Ready: containerd and the kubelet run it" if worker is not None else "registered"
        print(f"control plane ready at {plane.server}; node {args.node} {how}")
        if worker is not None and worker.kubelet is not None:
            kubelet = worker.kubelet
            print(f"agent flags: --registry-dir {kubelet.registry_dir} --plugins-dir {kubelet.plugins_dir} "
                  f"--cdi-dir {worker.cdi_dir}; images {worker.busybox} and {worker.pause}")
        print(f"export KUBECONFIG={plane.admin_kubeconfig} PATH={folder}:$PATH")
        print(f"logs in {work / 'logs'}; Ctrl-C stops everything", flush=True)
        while not stop.wait(1.0):
            plane.check_alive()
            if worker is not None:
                worker.ready(kubectl)  # raises when containerd or the kubelet exited
    except KeyboardInterrupt:
        pass
    except ComponentFailed as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        if worker is not None:
            worker.stop()
        plane.stop(keep=args.dir is not None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the pinned components into the cache and print their folder")
    commands.add_parser("agent-image", help="build the agent's image (scripts/build-image.sh) into the cache as "
                        "an OCI archive for the node's containerd, or find it there; print its name and archive")
    up = commands.add_parser("up", help="start a control plane on 127.0.0.1 until Ctrl-C")
    up.add_argument("--dir", help="keep the cluster's files here (default: a new temporary folder, removed after)")
    up.add_argument("--node", default=DEFAULT_NODE, help=f"the node to register (default {DEFAULT_NODE})")
    up.add_argument("--deploy", action="store_true", help="apply deploy/ (kubectl apply --server-side -k; "
                    "without its DaemonSet with --kubelet, whose host folders are not the node's: "
                    "cluster/agent_daemonset.py makes an overlay for the node)")
    up.add_argument("--kubelet", action="store_true",
                    help="run the node: containerd and the kubelet (as root), instead of registering it")
    up.add_argument("-v", type=int, default=1, metavar="N", help="the components' log verbosity (default 1)")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(*build(), sep="\n")
        return 0
    if args.command == "agent-image":
        return agent_image.main()
    return _up(args)


if __name__ == "__main__":
    sys.exit(main())
