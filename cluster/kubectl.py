"""kubectl, as the cluster's users run it: one call per command, JSON out, the server's message on failure."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Kubectl", "KubectlError"]


class KubectlError(RuntimeError):
    """kubectl exited non-zero; `stderr` holds what it said (the API server's message among it)."""

    def __init__(self, argv: Sequence[str], code: int, stderr: str) -> None:
        super().__init__(f"kubectl {' '.join(argv)} exited {code}: {stderr.strip()}")
        self.code = code
        self.stderr = stderr


@dataclass(frozen=True)
class Kubectl:
    """The built kubectl with one kubeconfig."""

    binary: Path
    kubeconfig: Path

    def run(self, *argv: str, input: str | None = None, timeout: float = 60.0) -> str:
        """Run `kubectl argv...`; its standard output, or KubectlError."""
        done = subprocess.run([str(self.binary), f"--kubeconfig={self.kubeconfig}", *argv], input=input,
                              capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise KubectlError(argv, done.returncode, done.stderr)
        return done.stdout

    def json(self, *argv: str, input: str | None = None) -> Any:
        """Run with `-o json` and decode the answer."""
        return json.loads(self.run(*argv, "-o", "json", input=input))

    def apply(self, objects: Sequence[dict[str, Any]] | dict[str, Any], *argv: str) -> str:
        """Server-side apply of objects given as Python data."""
        items = objects if isinstance(objects, Sequence) else [objects]
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)})
        return self.run("apply", "--server-side", "--field-manager=cluster-tests", "-f", "-", *argv, input=body)

    def create(self, obj: dict[str, Any], *argv: str) -> Any:
        return json.loads(self.run("create", "-f", "-", "-o", "json", *argv, input=json.dumps(obj)))

    def get(self, kind: str, name: str = "", *argv: str) -> Any:
        """An object (or a list without a name); None when it does not exist."""
        try:
            return self.json("get", kind, *([name] if name else []), *argv)
        except KubectlError as e:
            if "NotFound" in e.stderr or "not found" in e.stderr:
                return None
            raise
