"""The agent's settings: one frozen object resolved from flags, environment, a YAML file and defaults.

Precedence is flags > environment > file > defaults. Environment names are `DRA_AGENT_<SETTING>` (upper case),
plus the conventional `NODE_NAME` and `KUBECONFIG`. Errors name the setting, the value and where it came from.

The environment and the file are read through pydantic-settings' sources (`EnvSettingsSource` with the
`DRA_AGENT_` prefix, `YamlConfigSettingsSource`); `load_settings` layers them itself, one source at a time, so that
an error can name the source of each value. A `Settings` made in code reads nothing but its arguments.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from agent.kube.names import is_dns_label, is_driver_name, is_node_name

__all__ = ["ENV_PREFIX", "Settings", "SettingsError", "lies_under", "load_settings", "resolve_settings",
           "unknown_environment"]

ENV_PREFIX = "DRA_AGENT_"

# Settings that also answer to a conventional variable; the DRA_AGENT_ spelling wins when both are set.
_CONVENTIONAL_ENV = {"node_name": "NODE_NAME", "kubeconfig": "KUBECONFIG"}

# DRA_AGENT_ variables that are no setting: the config file's path, the failure points of crash tests, and the
# time factor of a simulated node's waits (`--simulate`).
_OTHER_ENV = frozenset({f"{ENV_PREFIX}CONFIG", f"{ENV_PREFIX}FAILPOINTS", f"{ENV_PREFIX}TEST_TIME_FACTOR"})

class SettingsError(Exception):
    """The settings are invalid; the message lists every problem with its source."""


class Settings(BaseSettings):
    """Everything the agent is configured with."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", env_prefix=ENV_PREFIX, case_sensitive=True)

    node_name: str | None = None
    """The Kubernetes node this agent serves; the pool name of every driver."""
    kubeconfig: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    """auto: JSON when the log stream is not a terminal, readable console lines when it is."""
    simulate: str | None = None
    """A built-in simulated node profile or the path of a profile YAML file."""
    sim_root: Path | None = None
    """Keep the simulated node in this folder across runs (default: a temporary folder, removed at exit)."""
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    host_root: Path = Path("/")
    """Where the host's file system is seen (e.g. /host in a container): the boot id and host files are read there."""
    host_netns: str = "auto"
    """The network namespace to open the link and uevent sockets in: "auto" (the host's, `<host_root>/proc/1/ns/net`,
    entered when the agent runs in another), "off" (the agent's own), or the path of a namespace file."""
    driver_root: Path | None = None
    """Where the GPU driver's user-space files (libraries, binaries) are seen, below `host_root`: `host_root`
    itself (the default) for a driver installed on the host, `<host_root>/run/nvidia/driver` for the GPU
    operator's driver container. The container runtime on the host sees them at the part below `host_root`."""
    registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    """Where the kubelet looks for plugin registration sockets."""
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    """Each driver's DRA socket goes to <plugins_dir>/<driver>/."""
    cdi_dir: Path = Path("/var/run/cdi")
    """Where CDI specs are written for the container runtime."""
    cdi_host_root: Path = Path("/")
    """Where the container runtime reading the CDI specs sees the host root: the host paths of claims' specs are
    written below it. / for a runtime on the host; a simulated node's root for the machine's own runtime, which
    finds the node's /dev entries and driver files there."""
    state_dir: Path = Path("/var/lib/dra-agent")
    """The checkpoint of prepared claims, per driver."""
    pod_uid: str | None = None
    """The agent pod's UID, during DaemonSet rolling updates: socket names carry it, instances share state."""
    metrics_address: str | None = None
    """HOST:PORT for /metrics, /healthz and /readyz; off when unset."""
    backends: tuple[str, ...] | None = None
    """Backends to load by entry-point name; every installed backend when unset."""
    health_timeout: int = Field(default=30, ge=2, le=3600)
    """Seconds the kubelet waits for news of a device before it reads as Unknown; the agent re-sends every
    device's health every half of it."""
    reap_interval: float = Field(default=600.0, gt=0, le=86400)
    """Seconds between two checks of the prepared claims against the API server (the first comes at start): a claim
    whose ResourceClaim is gone, replaced or no longer allocated to this node is unprepared."""
    reap_grace: float = Field(default=300.0, ge=0, le=86400)
    """Seconds a prepared claim must have been found gone before it is unprepared: the kubelet's own unprepare may
    still be on its way."""
    claim_status: bool = True
    """Write each prepared device's entry (Ready, its facts, its network data) in its ResourceClaim's
    status.devices, and remove it at unprepare; off: the agent never writes claims."""
    no_execute: tuple[str, ...] = ()
    """Health causes (e.g. gpu-lost, xid) whose device taint has effect NoExecute, evicting the pods that use
    the device; every other unhealthy device is tainted NoSchedule."""
    driver_names: dict[str, str] = Field(default_factory=dict)
    """Publish under another DRA driver name: default driver name → name to use."""
    device_metadata: bool = False
    """Give containers a device metadata file per claim request (KEP-5304): the devices' attributes (a VM launcher
    finds its PCI address there) under /var/run/kubernetes.io/dra-device-attributes/, mounted through CDI. Needs a
    kubelet that calls DRA API v1 (Kubernetes 1.34 or later)."""
    backend_config: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-backend configuration, keyed by backend name; each backend validates its own section."""
    allowed_configs: tuple[str, ...] = ()
    """The reconfigurations claims may ask for on this node through their opaque parameters, by name (`VfioConfig`,
    `GpuConfig.sharing.TimeSlicing`, `VfConfig.netDevice`, ...): a claim asking for any other fails, naming this
    setting. None by default: each of them reaches beyond the claim's own use of its device (see
    docs/configuration.md)."""

    @field_validator("node_name")
    @classmethod
    def _node_name(cls, v: str | None) -> str | None:
        if v is not None and not is_node_name(v):
            raise ValueError("must be a valid node name: lower-case letters, digits, '-' and '.', at most 253")
        return v

    @field_validator("driver_root")
    @classmethod
    def _driver_root(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        if v is None:
            return v
        if not v.is_absolute():
            raise ValueError("must be an absolute path, e.g. /host or /host/run/nvidia/driver")
        host = info.data.get("host_root")
        # A simulated node brings its own host root, known only once the node is open (agent.node.host checks there).
        if info.data.get("simulate") is None and isinstance(host, Path) and not lies_under(v, host):
            raise ValueError(f"must lie under host_root {host}: the container runtime on the host finds the "
                             "driver's files at the part of this path below host_root (e.g. host_root /host, "
                             "driver_root /host/run/nvidia/driver → /run/nvidia/driver on the host)")
        return v

    @field_validator("pod_uid")
    @classmethod
    def _pod_uid(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", v):
            raise ValueError("must be a pod UID such as 3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b")
        return v

    @field_validator("host_netns")
    @classmethod
    def _host_netns(cls, v: str) -> str:
        if v not in ("auto", "off") and not v.startswith("/"):
            raise ValueError('must be "auto", "off" or the absolute path of a network namespace file, '
                             "e.g. /proc/1/ns/net or /run/netns/NAME")
        return v

    @field_validator("metrics_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            port = v.rpartition(":")[2]
            if not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError("must be HOST:PORT or :PORT, e.g. :9477")
        return v

    @field_validator("backends")
    @classmethod
    def _backend_names(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and (not v or any(not name for name in v)):
            raise ValueError("must list at least one backend name, without empty entries")
        return v

    @field_validator("no_execute")
    @classmethod
    def _causes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [cause for cause in v if not is_dns_label(cause)]
        if bad:
            raise ValueError(f"health causes are DNS labels such as gpu-lost or link-down, got {bad}")
        return v

    @field_validator("allowed_configs")
    @classmethod
    def _reconfiguration_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [name for name in v if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(\.[A-Za-z][A-Za-z0-9]*)*", name)]
        if bad:
            raise ValueError(f"reconfigurations are named like VfioConfig or GpuConfig.sharing.TimeSlicing, got {bad}")
        return v

    @field_validator("driver_names")
    @classmethod
    def _driver_names(cls, v: dict[str, str]) -> dict[str, str]:
        for new in v.values():
            if not is_driver_name(new) or new != new.lower():
                raise ValueError(f"{new!r} is not a valid DRA driver name (a DNS subdomain of at most 63)")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only the arguments: `load_settings` layers the file and the environment, to name each value's source.
        return (init_settings,)

    @property
    def effective_driver_root(self) -> Path:
        """`driver_root`, or `host_root` when unset."""
        return self.driver_root if self.driver_root is not None else self.host_root

    def driver_name(self, default: str) -> str:
        """The driver name to publish under for a backend whose default driver name is `default`."""
        return self.driver_names.get(default, default)


def lies_under(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or below it, by their names (`..` taken into account, links not followed: the
    container runtime on the host knows nothing of this process's links)."""
    inner, outer = os.path.normpath(path), os.path.normpath(root)
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def load_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config_file: Path | None = None,
) -> Settings:
    """Resolve settings. `flags` holds only the flags the user gave (None values are ignored)."""
    return resolve_settings(flags, environ, config_file)[0]


def resolve_settings(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    config_file: Path | None = None,
) -> tuple[Settings, dict[str, str]]:
    """`load_settings`, and where each setting that was given came from (setting → `config file F`, `environment
    V` or `flag --f`), for the checks that need the installed backends (agent/node/plugin_settings.py)."""
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if config_file is not None:
        for key, value in _read_file(config_file).items():
            values[key], origin[key] = value, f"config file {config_file}"
    environment = _Environment(environ)
    for key, value in environment().items():
        values[key], origin[key] = value, f"environment {environment.name_of(key)}"
    for key, value in flags.items():
        if value is not None:
            values[key], origin[key] = value, f"flag --{key.replace('_', '-')}"
    try:
        return Settings(**values), origin
    except ValidationError as e:
        lines = ["invalid settings:"]
        for err in e.errors():
            key = str(err["loc"][0]) if err["loc"] else "(settings)"
            where = origin.get(key, "default")
            shown = f" = {values[key]!r}" if key in values else ""
            detail = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                detail = f"unknown setting; known settings: {', '.join(Settings.model_fields)}"
            lines.append(f"  {key}{shown} (from {where}): {detail}")
        raise SettingsError("\n".join(lines)) from None


def unknown_environment(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The DRA_AGENT_ variables that name no setting (a misspelling is otherwise ignored without a word), each with
    the setting's variable it most resembles, if one does."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    found = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known and name not in _OTHER_ENV:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            found.append((name, close[0] if close else None))
    return found


class _Environment(EnvSettingsSource):
    """`DRA_AGENT_<SETTING>` from the given variables (upper case), then the conventional names; lists are
    comma-separated and mappings are JSON objects."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._given = environ
        super().__init__(Settings)

    def name_of(self, key: str) -> str:
        """The variable that gave setting `key`."""
        prefixed = ENV_PREFIX + key.upper()
        return prefixed if prefixed in self._given else _CONVENTIONAL_ENV.get(key, prefixed)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        value = self._given.get(ENV_PREFIX + field_name.upper())
        conventional = _CONVENTIONAL_ENV.get(field_name)
        if value is None and conventional is not None:
            value = self._given.get(conventional)
        return value, field_name, False

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if str(field.annotation).startswith("tuple"):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            name = self.name_of(field_name)
            raise SettingsError(f"invalid settings:\n  environment {name}: expected a JSON object: {e}") from None


class _File(YamlConfigSettingsSource):
    """A YAML config file, which must exist and hold a mapping; its keys may be dashed (`node-name`)."""

    def __init__(self, path: Path) -> None:
        super().__init__(Settings, yaml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        path = Path(file_path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise SettingsError(f"config file {path} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise SettingsError(f"config file {path} must hold a mapping of setting names to values")
        return {str(k).replace("-", "_"): v for k, v in data.items()}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        if not path.is_file():  # the source would skip it quietly, but a config file that was named must be read
            path.open().close()  # raises why: no such file, a folder
        return _File(path)()
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e.strerror or e}") from None
