"""The agent's API client loads only the parts of the Kubernetes package it uses, and a program that uses the rest
of the package after it still gets the whole package.

Each check runs in a fresh interpreter: the test process has long loaded everything.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _run(code: str) -> object:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_client_loads_neither_the_synchronous_client_nor_the_other_async_modules() -> None:
    loaded = _run("import json, sys\n"
                  "import agent.kube.client\n"
                  "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0].startswith('kubernetes'))))")
    assert isinstance(loaded, list)
    assert {"kubernetes.aio.client.api_client", "kubernetes.aio.config.kube_config"} <= set(loaded)
    unwanted = ("kubernetes.client", "kubernetes.config", "kubernetes.dynamic", "kubernetes.watch",
                "kubernetes.aio.dynamic", "kubernetes.aio.watch", "kubernetes_validate")
    assert not [m for m in loaded if any(m == u or m.startswith(u + ".") for u in unwanted)], loaded


def test_the_whole_package_is_there_for_whoever_uses_it_afterwards() -> None:
    found = _run("import json\n"
                 "import agent.kube.client\n"
                 "import kubernetes\n"
                 "from kubernetes.aio import watch\n"
                 "from kubernetes.aio.client import CoreV1Api\n"
                 "print(json.dumps([kubernetes.__version__, kubernetes.client.CoreV1Api.__name__,\n"
                 "                  watch.Watch.__name__, CoreV1Api.__module__]))")
    assert isinstance(found, list)
    assert found[1:] == ["CoreV1Api", "Watch", "kubernetes.aio.client.api.core_v1_api"]
    assert found[0]
