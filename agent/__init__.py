"""dra-agent: the node-local Kubernetes Dynamic Resource Allocation agent."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dra-agent")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
