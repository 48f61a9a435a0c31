"""CDI spec model: frozen dataclasses, their JSON encoding (the CDI keys) and the minimum spec version."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from functools import reduce
from types import MappingProxyType, UnionType
from typing import Any, Generic, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")
D = TypeVar("D")
V = TypeVar("V")
_REQUIRED = {"required": True}  # field metadata: always written, and must be present when read

# Versions the CDI loader knows; a spec declaring any other version is rejected by it.
KNOWN_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
BASELINE_VERSION = "0.3.0"


class CdiSpecError(ValueError):
    """A spec document that does not decode into the model, or a spec that fails validation."""


def _freeze(obj: Any) -> None:
    """Turn list arguments into tuples and mappings into read-only copies, so frozen means frozen."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            object.__setattr__(obj, f.name, tuple(value))
        elif isinstance(value, Mapping):
            object.__setattr__(obj, f.name, MappingProxyType(dict(value)))


@dataclass(frozen=True)
class DeviceNode:
    """A device node made available in the container; `host_path` defaults to `path`."""

    path: str
    host_path: str | None = None
    permissions: str | None = None
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    uid: int | None = None
    gid: int | None = None

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class Mount:
    """A mount from the host into the container (a bind mount unless `type` says otherwise)."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")
    type: str | None = None

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class Hook:
    """An OCI hook run by the container runtime."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class NetDevice:
    """A host network interface moved into the container's network namespace (CDI 1.1.0)."""

    host_interface_name: str
    name: str


def _union(first: tuple[T, ...], second: tuple[T, ...]) -> tuple[T, ...]:
    return tuple(dict.fromkeys((*first, *second)))


@dataclass(frozen=True)
class ContainerEdits:
    """Edits applied to a container that uses a device."""

    env: tuple[str, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = ()
    net_devices: tuple[NetDevice, ...] = ()

    def __post_init__(self) -> None:
        _freeze(self)

    def is_empty(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def merge(self, other: ContainerEdits) -> ContainerEdits:
        """These edits followed by `other`'s, in order, each exact duplicate kept once (first place)."""
        return ContainerEdits(
            env=_union(self.env, other.env),
            device_nodes=_union(self.device_nodes, other.device_nodes),
            mounts=_union(self.mounts, other.mounts),
            hooks=_union(self.hooks, other.hooks),
            additional_gids=_union(self.additional_gids, other.additional_gids),
            net_devices=_union(self.net_devices, other.net_devices),
        )


@dataclass(frozen=True)
class Device:
    """One named device of a spec; its qualified name is `<kind>=<name>`."""

    name: str
    # Required by the schema, so always written even when empty.
    container_edits: ContainerEdits = field(default=ContainerEdits(), metadata=_REQUIRED)
    # Mappings are unhashable; equality still compares them.
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class Spec:
    """A CDI spec document; `cdi_version` None means "the minimum this content needs"."""

    kind: str
    devices: tuple[Device, ...]
    container_edits: ContainerEdits = ContainerEdits()
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False)
    cdi_version: str | None = field(default=None, metadata=_REQUIRED)

    def __post_init__(self) -> None:
        _freeze(self)

    def version(self) -> str:
        """The `cdiVersion` written for this spec."""
        return self.cdi_version if self.cdi_version is not None else minimum_version(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document, `cdiVersion` first."""
        return self._document(shared=False)

    def to_json(self, indent: int | None = 2) -> str:
        # The document is serialized at once and dropped, so it may hold the shared JSON values of edits.
        return json.dumps(self._document(shared=True), indent=indent) + "\n"

    def _document(self, shared: bool) -> dict[str, Any]:
        body: dict[str, Any] = _encode(self, shared)
        del body["cdiVersion"]
        return {"cdiVersion": self.version(), **body}

    @classmethod
    def from_dict(cls, data: object) -> Spec:
        """Decode strictly, like the CDI loader: unknown fields, missing required ones and wrong types raise."""
        return _decode(cls, data, "spec")

    @classmethod
    def from_json(cls, text: str | bytes) -> Spec:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise CdiSpecError(f"spec is not valid JSON: {e}") from e
        return cls.from_dict(data)


def edits_to_dict(edits: ContainerEdits) -> dict[str, Any]:
    """The CDI `containerEdits` JSON object of `edits`."""
    result: dict[str, Any] = _encode(edits)
    return result


def shared_edits_dict(edits: ContainerEdits) -> dict[str, Any]:
    """`edits_to_dict(edits)`, worked out once per edits object and shared by every caller: for a document that is
    serialized at once. Never change what it returns."""
    return _SHARED_EDITS.get((edits,), lambda: edits_to_dict(edits))


def merged(edits: Sequence[ContainerEdits]) -> ContainerEdits:
    """Empty edits merged with each of `edits` in turn (`ContainerEdits.merge`), worked out once per sequence of
    edits objects: the same object for the same edits objects, so its JSON value is shared too."""
    return _MERGED.get(tuple(edits), lambda: reduce(ContainerEdits.merge, edits, ContainerEdits()))


class _PerObjects(Generic[V]):
    """Values worked out once per tuple of objects, by identity, for the most recently used few. A backend hands the
    same edits object (its driver's files: a dozen mounts and more) to every claim it prepares, and a prepare
    merges and encodes it several times: by identity, a hit costs no hashing or comparing of what it holds. The
    objects are kept alive with their value, so their ids are not reused while cached. Safe from several threads."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: dict[tuple[int, ...], tuple[tuple[object, ...], V]] = {}
        self._lock = threading.Lock()

    def get(self, objects: tuple[object, ...], make: Callable[[], V]) -> V:
        key = tuple(map(id, objects))
        with self._lock:
            hit = self._items.pop(key, None)
            if hit is not None:
                self._items[key] = hit  # the most recently used last
                return hit[1]
        value = make()
        with self._lock:
            self._items[key] = (objects, value)
            while len(self._items) > self._size:
                del self._items[next(iter(self._items))]
        return value


_SHARED_EDITS: _PerObjects[dict[str, Any]] = _PerObjects(32)
_MERGED: _PerObjects[ContainerEdits] = _PerObjects(32)


def edits_from_dict(data: object) -> ContainerEdits:
    """Decode a CDI `containerEdits` JSON object strictly."""
    return _decode(ContainerEdits, data, "containerEdits")


# --- JSON codec: field names map to the CDI keys by camelCase, e.g. host_path -> hostPath ----------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _is_required(f: Field[Any]) -> bool:
    return f.metadata.get("required", False) or (f.default is MISSING and f.default_factory is MISSING)


_Layout = tuple[tuple[str, str, bool], ...]
_LAYOUTS: dict[type, _Layout | None] = {}  # per type met: its fields' layout, None for a type that is no model
_PLAIN = (str, int, float, bool, type(None))


def _layout(cls: type) -> _Layout | None:
    """(attribute, JSON key, required) per field of a model class (None for any other type), worked out once per
    type: specs and checkpoint records are encoded on every prepare, and working this out per object, or even
    asking `is_dataclass` per value, cost more than the rest of the encoding."""
    try:
        return _LAYOUTS[cls]
    except KeyError:
        layout = tuple((f.name, _camel(f.name), _is_required(f)) for f in fields(cls)) if is_dataclass(cls) else None
        _LAYOUTS[cls] = layout
        return layout


def _encode(value: Any, shared: bool = False) -> Any:
    """JSON value of a model object; optional fields that are None or empty are left out. With `shared`, the values
    of edits are those of `shared_edits_dict`."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is tuple:
        return [item if type(item) is str else _encode(item, shared) for item in value]
    if shared and kind is ContainerEdits:
        return shared_edits_dict(value)
    layout = _layout(kind)
    if layout is not None:
        out: dict[str, Any] = {}
        for name, key, required in layout:
            item = getattr(value, name)
            if type(item) is not str:
                item = _encode(item, shared)
            if required or item not in (None, "", [], {}):
                out[key] = item
        return out
    if isinstance(value, tuple):
        return [_encode(item, shared) for item in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _decode(cls: type[D], data: object, where: str) -> D:
    """Build `cls` from a JSON object, refusing unknown keys, missing required keys and wrong types."""
    if not isinstance(data, dict):
        raise CdiSpecError(f"{where}: expected an object, got {data!r}")
    by_key = {_camel(f.name): f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(by_key))
    if unknown:
        raise CdiSpecError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(by_key)}")
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, f in by_key.items():
        if data.get(key) is not None:
            kwargs[f.name] = _convert(hints[f.name], data[key], f"{where}.{key}")
        elif _is_required(f):
            raise CdiSpecError(f"{where}: missing required field {key!r}")
        else:
            kwargs[f.name] = _absent(hints[f.name])
    return cls(**kwargs)


def _absent(hint: Any) -> Any:
    """The value of an optional field missing from the document (not the constructor default)."""
    origin = get_origin(hint)
    if origin is tuple:
        return ()
    if origin is Mapping:
        return {}
    if isinstance(hint, type) and is_dataclass(hint):
        return hint()
    return None


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):  # "X | None": None was handled by the caller
        return _convert(next(a for a in args if a is not type(None)), value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise CdiSpecError(f"{where}: expected a list, got {value!r}")
        return tuple(_convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if origin is Mapping:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise CdiSpecError(f"{where}: expected an object of strings, got {value!r}")
        return value
    if isinstance(hint, type) and is_dataclass(hint):
        return _decode(hint, value, where)
    # bool is an int subclass in Python but not a JSON integer.
    if not isinstance(value, hint) or isinstance(value, bool):
        raise CdiSpecError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


# --- versions ---------------------------------------------------------------------------------


def parse_version(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a known CDI version ("v" prefix tolerated), else None."""
    plain = version.removeprefix("v")
    if plain not in KNOWN_VERSIONS:
        return None
    major, minor, patch = (int(p) for p in plain.split("."))
    return major, minor, patch


def _starts_with_digit(name: str) -> bool:
    return name[:1] in tuple("0123456789")


def minimum_version(spec: Spec) -> str:
    """The lowest cdiVersion that can express everything `spec` uses."""
    edits = [spec.container_edits, *(d.container_edits for d in spec.devices)]
    cls = spec.kind.partition("/")[2]
    if any(e.net_devices for e in edits):
        return "1.1.0"
    if any(e.additional_gids for e in edits):
        return "0.7.0"
    if spec.annotations or any(d.annotations for d in spec.devices) or "." in cls:
        return "0.6.0"
    if any(n.host_path for e in edits for n in e.device_nodes) or any(_starts_with_digit(d.name) for d in spec.devices):
        return "0.5.0"
    if any(m.type for e in edits for m in e.mounts):
        return "0.4.0"
    return BASELINE_VERSION
