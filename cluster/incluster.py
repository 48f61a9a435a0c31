"""What a cluster whose node runs pods needs in its API beyond the defaults: the API server's right to call the
kubelet, and the loopback address of the API server in every pod; and deploy/ as such a cluster takes it.

- The API server calls the kubelet (logs, exec, the node's metrics through the proxy) as `kube-apiserver`, its
  client certificate's name; the kubelet asks the API server whether that user may (webhook authorization), so the
  user is bound to `system:kubelet-api-admin`, as upstream's local-up-cluster binds it.
- A pod finds the API server through the environment the kubelet gives it from the `kubernetes` Service:
  `KUBERNETES_SERVICE_HOST` is the Service's cluster IP (10.0.0.1 here) and `KUBERNETES_SERVICE_PORT` 443. No
  kube-proxy routes that address here, and nothing may be sent to it: the API server listens on 127.0.0.1 only.
  The kubelet has no setting for that address, and a container's own environment entries win over the Service's,
  so a mutating admission policy writes both into every container of every new pod: 127.0.0.1 and the API server's
  port. Client libraries' in-cluster configuration (client-go's, the Python client's) reads exactly these two;
  the server's certificate names 127.0.0.1. Init containers are not changed.
- deploy/ goes in without its DaemonSet: its image names a registry (containerd would try it, off this machine), and
  its host folders (/var/lib/kubelet, /var/run/cdi, /var/lib/dra-agent) are the machine's, not the node's, whose
  kubelet and CDI folders are below the cluster's folder. The DaemonSet goes in through an overlay made for the
  node, with the agent's image imported there (`cluster.agent_daemonset`), or the agent runs as a host process with
  the DaemonSet's arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cluster.kubectl import Kubectl

__all__ = ["apply_deploy", "loopback_api_address", "node_objects"]

_POLICY = "dra-agent-cluster-loopback-api-address"


def loopback_api_address(port: int) -> list[dict[str, Any]]:
    """The mutating admission policy (and its binding) that gives every container of a new pod the API server's
    loopback address as its in-cluster address."""
    env = (f'[Object.spec.containers.env{{name: "KUBERNETES_SERVICE_HOST", value: "127.0.0.1"}}, '
           f'Object.spec.containers.env{{name: "KUBERNETES_SERVICE_PORT", value: "{port}"}}]')
    expression = (f"Object{{spec: Object.spec{{containers: object.spec.containers.map(c, "
                  f"Object.spec.containers{{name: c.name, env: {env}}})}}}}")
    return [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
         "metadata": {"name": _POLICY},
         "spec": {
             "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                     "operations": ["CREATE"], "resources": ["pods"]}]},
             "failurePolicy": "Fail", "reinvocationPolicy": "Never",
             "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": expression}}],
         }},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicyBinding",
         "metadata": {"name": _POLICY}, "spec": {"policyName": _POLICY}},
    ]


def node_objects(api_port: int) -> list[dict[str, Any]]:
    """Every object a cluster with a running node needs (see the module's description)."""
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "kube-apiserver-kubelet-api-admin"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:kubelet-api-admin"},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "kube-apiserver"}]},
        *loopback_api_address(api_port),
    ]


def apply_deploy(kubectl: Kubectl, deploy: Path) -> None:
    """deploy/ as `kubectl apply -k` applies it, without the DaemonSet (see the module's description)."""
    objects = [o for o in yaml.safe_load_all(kubectl.run("kustomize", str(deploy))) if o and o["kind"] != "DaemonSet"]
    kubectl.apply(objects)
