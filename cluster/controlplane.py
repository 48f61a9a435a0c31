"""A Kubernetes control plane on one machine, on 127.0.0.1 only: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, started from the binaries `cluster/build.sh` made, as upstream's `hack/local-up-cluster.sh`
starts them.

What differs from upstream's script, and why:

- every listener binds 127.0.0.1, and the API server advertises 127.0.0.1 with the endpoint reconciler off (as
  upstream's own integration test server does), so no component ever sends to the machine's other addresses or
  to the Service range;
- ports are free ones picked at start, so several clusters (and other tests) can run on one machine;
- keys are P-256 (faster to make), the service-account key RSA as upstream makes it;
- the API server writes an audit log of every request of the agent's service accounts: tests read the agent's
  requests and the authorization decisions from it.

Without a kubelet (`with_kubelet=False`) the node lifecycle controller is left out: nothing would renew the
node's lease, the controller would taint the node unreachable after its grace period, and the scheduler would
place nothing there. With one (`cluster.worker` starts it), the controller runs, the certificates include the
kubelet's client and serving pairs for `node_name`, and the API server checks the kubelet's serving certificate
against the server CA that signed it (`--kubelet-certificate-authority`), as a cluster whose kubelets hold
certificates of its own CA is set up.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.pki import Pki, write_kubeconfig
from cluster.processes import Component, ComponentFailed, free_port, get

__all__ = ["AGENT_SERVICE_ACCOUNT_GROUP", "SERVICE_CIDR", "ControlPlane"]

SERVICE_CIDR = "10.0.0.0/24"
_SERVICE_IP = "10.0.0.1"  # the first address of the range: the `kubernetes` Service's, named in the serving cert
AGENT_SERVICE_ACCOUNT_GROUP = "system:serviceaccounts:dra-agent"
_ADMISSION_PLUGINS = (
    "NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,Priority,MutatingAdmissionWebhook,"
    "ValidatingAdmissionWebhook,ValidatingAdmissionPolicy,ResourceQuota,NodeRestriction,PodSecurity"
)
_AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "userGroups": [AGENT_SERVICE_ACCOUNT_GROUP]}, {"level": "None"}],
}


@dataclass
class ControlPlane:
    """The control plane's files under `folder`, its components, and how to reach it.

    `start()` brings it up and returns when every component is ready; `stop()` stops them all and, unless `keep`,
    removes the folder. `admin_kubeconfig` authenticates as system:admin (system:masters).
    """

    folder: Path
    binaries: Path
    with_kubelet: bool = False
    node_name: str = "127.0.0.1"
    """The kubelet's node, when there is one."""
    verbosity: int = 1
    apiserver_args: Sequence[str] = ()
    """More kube-apiserver flags, after the ones it is always started with (e.g. an admission configuration)."""
    components: list[Component] = field(default_factory=list)
    api_port: int = 0
    pki: Pki | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.folder / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.folder / "logs" / "kube-apiserver-audit.log"

    @property
    def ca(self) -> Path:
        assert self.pki is not None, "the control plane is not started"
        return self.pki.server_ca.cert

    def _bin(self, name: str) -> str:
        return str(self.binaries / name)

    def start(self, *, timeout: float = 120.0) -> None:
        """Generate the certificates and start etcd, the API server, the controller manager and the scheduler,
        each once the one before is ready."""
        self.folder.mkdir(parents=True, exist_ok=True)
        pki = self.pki = Pki.create(self.folder / "pki", service_ip=_SERVICE_IP,
                                    nodes=[self.node_name] if self.with_kubelet else [])
        self.api_port = free_port()
        write_kubeconfig(self.admin_kubeconfig, self.server, pki.server_ca.cert, client=pki.clients["admin"],
                         user="admin")
        try:
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controller_manager(timeout)
            self._start_scheduler(timeout)
        except BaseException:
            self.stop(keep=True)
            raise

    def _component(self, name: str, argv: Sequence[str]) -> Component:
        component = Component(name, argv, self.folder / "logs" / f"{name}.log")
        self.components.append(component)
        component.start()
        return component

    def _start_etcd(self, timeout: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        etcd = self._component("etcd", [
            self._bin("etcd"), "--name=default", f"--data-dir={self.folder / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            # A test cluster's data need not survive a power cut; fsyncs would make every write wait for the disk.
            "--unsafe-no-fsync", "--log-level=warn",
        ])
        etcd.wait_ready(f"{self.etcd_url}/health", timeout=timeout)

    def _start_apiserver(self, timeout: float) -> None:
        assert self.pki is not None
        pki, logs = self.pki, self.folder / "logs"
        audit_policy = self.folder / "audit-policy.yaml"
        audit_policy.write_text(yaml.safe_dump(_AUDIT_POLICY))
        apiserver = self._component("kube-apiserver", [
            self._bin("kube-apiserver"), f"--v={self.verbosity}",
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--cert-dir={pki.folder}",
            f"--tls-cert-file={pki.serving.cert}", f"--tls-private-key-file={pki.serving.key}",
            f"--client-ca-file={pki.client_ca.cert}",
            f"--kubelet-client-certificate={pki.clients['kube-apiserver'].cert}",
            f"--kubelet-client-key={pki.clients['kube-apiserver'].key}",
            "--kubelet-preferred-address-types=Hostname",
            *([f"--kubelet-certificate-authority={pki.server_ca.cert}"] if self.with_kubelet else []),
            f"--service-account-key-file={pki.service_account_key}",
            f"--service-account-signing-key-file={pki.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-account-jwks-uri=https://kubernetes.default.svc/openid/v1/jwks",
            "--service-account-lookup=true",
            "--authorization-mode=Node,RBAC",
            f"--enable-admission-plugins={_ADMISSION_PLUGINS}",
            "--allow-privileged=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--requestheader-client-ca-file={pki.request_header_ca.cert}",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-", "--requestheader-allowed-names=system:auth-proxy",
            f"--proxy-client-cert-file={pki.clients['auth-proxy'].cert}",
            f"--proxy-client-key-file={pki.clients['auth-proxy'].key}",
            f"--audit-policy-file={audit_policy}", f"--audit-log-path={logs / 'kube-apiserver-audit.log'}",
            "--audit-log-mode=blocking",
            "--profiling=false",
            *self.apiserver_args,
        ])
        admin = pki.clients["admin"]
        apiserver.wait_ready(f"{self.server}/readyz", timeout=timeout, ca=pki.server_ca.cert,
                             cert=(admin.cert, admin.key))

    def _start_controller_manager(self, timeout: float) -> None:
        assert self.pki is not None
        pki, port = self.pki, free_port()
        kubeconfig = write_kubeconfig(self.folder / "controller.kubeconfig", self.server, pki.server_ca.cert,
                                      client=pki.clients["controller"], user="controller")
        controllers = "*" if self.with_kubelet else "*,-node-lifecycle-controller"
        kcm = self._component("kube-controller-manager", [
            self._bin("kube-controller-manager"), f"--v={self.verbosity}",
            f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--use-service-account-credentials",
            f"--service-account-private-key-file={pki.service_account_key}",
            f"--root-ca-file={pki.server_ca.cert}",
            f"--cluster-signing-cert-file={pki.client_ca.cert}", f"--cluster-signing-key-file={pki.client_ca.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--controllers={controllers}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={port}", f"--cert-dir={self.folder / 'kcm-certs'}",
            "--profiling=false",
        ])
        kcm.wait_ready(f"https://127.0.0.1:{port}/healthz", timeout=timeout)

    def _start_scheduler(self, timeout: float) -> None:
        assert self.pki is not None
        pki, port = self.pki, free_port()
        kubeconfig = write_kubeconfig(self.folder / "scheduler.kubeconfig", self.server, pki.server_ca.cert,
                                      client=pki.clients["scheduler"], user="scheduler")
        config = self.folder / "kube-scheduler.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "leaderElection": {"leaderElect": False},
        }))
        scheduler = self._component("kube-scheduler", [
            self._bin("kube-scheduler"), f"--v={self.verbosity}", f"--config={config}",
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", f"--cert-dir={self.folder / 'scheduler-certs'}",
            "--profiling=false",
        ])
        scheduler.wait_ready(f"https://127.0.0.1:{port}/healthz", timeout=timeout)

    def check_alive(self) -> None:
        """Raise ComponentFailed naming the first component that has exited."""
        for component in self.components:
            if not component.running():
                raise component.failed("is no longer running")

    def readyz(self) -> tuple[int, str]:
        assert self.pki is not None
        admin = self.pki.clients["admin"]
        status, body = get(f"{self.server}/readyz?verbose", ca=self.ca, cert=(admin.cert, admin.key))
        return status, body.decode(errors="replace")

    def pids(self) -> list[int]:
        return [c.pid for c in self.components if c.pid is not None and c.running()]

    def audit_events(self) -> list[dict[str, Any]]:
        """The audit log's events so far (the agent's service accounts' requests)."""
        try:
            lines = self.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def stop(self, *, keep: bool = False) -> None:
        """Stop the components in the reverse order of their start; remove the folder unless `keep`."""
        for component in reversed(self.components):
            component.stop()
        self.components.clear()
        if not keep:
            shutil.rmtree(self.folder, ignore_errors=True)


def wait_for(probe: Any, *, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Call `probe` until it returns something truthy; raise TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


__all__ += ["ComponentFailed", "wait_for"]
