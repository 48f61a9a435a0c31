"""The errors of the agent's requests to the Kubernetes API server: one that failed (`KubeError`), credentials that
cannot be loaded (`KubeconfigError`), and a request refused before it was sent because a value in its path or
selector is not valid for its kind (`InvalidRequestError`)."""

from __future__ import annotations

__all__ = ["InvalidRequestError", "KubeError", "KubeconfigError"]


class KubeError(Exception):
    """An API request failed; `status` is the HTTP status (0 when the server could not be reached)."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class KubeconfigError(KubeError):
    """The credentials cannot be loaded: the kubeconfig is missing or invalid, or the in-cluster ones are: a
    configuration problem, found before any request is made."""


class InvalidRequestError(KubeError):
    """A request that was never sent: a namespace, name or selector value it would carry is not valid for its kind.

    Its status is 400 (Bad Request), what the server answers a request it cannot take, so that every caller
    treats it as refused and none as an outage to wait out: sending the same request again cannot succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400, "BadRequest")
