"""Importing the agent's API client leaves the Kubernetes package as Python makes it: its `__init__.py` has run
when the agent's module is imported, no module-level hook stands in for it, and the names a program uses after
the agent are the package's own.

Each check runs in a fresh interpreter: the test process has long loaded everything.
"""

from __future__ import annotations

import json
import subprocess
import sys


def _run(code: str) -> object:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_client_leaves_the_kubernetes_packages_as_imported() -> None:
    found = _run("import json, sys\n"
                 "import agent.kube.client\n"
                 "packages = [sys.modules[name] for name in ('kubernetes', 'kubernetes.aio')]\n"
                 "print(json.dumps([[p.__name__, '__getattr__' in vars(p), '__version__' in vars(p),\n"
                 "                   'client' in vars(p)] for p in packages]))")
    # Each package's __init__.py ran (it sets the version and binds the `client` subpackage) and no hook of the
    # agent's answers for a name the package did not define.
    assert found == [["kubernetes", False, True, True], ["kubernetes.aio", False, True, True]]


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
