"""Typed access to the `kubernetes.aio` client's models in tests.

The client declares every field optional, since a model may be built empty; an object the API server returns
always has its metadata (and a list its list metadata), so these helpers hand them out as present, failing the
test where one is missing. `as_sent` passes a test's own JSON where the client's signature asks for a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, cast

from kubernetes.aio import client

_Model = TypeVar("_Model")
_Spec = TypeVar("_Spec", covariant=True)


class _WithMetadata(Protocol):
    @property
    def metadata(self) -> client.V1ObjectMeta | None: ...


class _WithListMetadata(Protocol):
    @property
    def metadata(self) -> client.V1ListMeta | None: ...


class _WithSpec(Protocol[_Spec]):
    @property
    def spec(self) -> _Spec | None: ...


def meta(obj: _WithMetadata) -> client.V1ObjectMeta:
    """The object's metadata."""
    assert obj.metadata is not None, f"{type(obj).__name__} without metadata"
    return obj.metadata


def list_meta(listed: _WithListMetadata) -> client.V1ListMeta:
    """The list's metadata (its resourceVersion and continue token)."""
    assert listed.metadata is not None, f"{type(listed).__name__} without metadata"
    return listed.metadata


def spec_of(obj: _WithSpec[_Model]) -> _Model:
    """The object's spec."""
    assert obj.spec is not None, f"{type(obj).__name__} without spec"
    return obj.spec


def name_of(obj: _WithMetadata) -> str:
    """The object's name."""
    name = meta(obj).name
    assert name is not None, f"{type(obj).__name__} without a name"
    return name


def version_of(obj: _WithMetadata | _WithListMetadata) -> str:
    """The object's (or the list's) resourceVersion."""
    assert obj.metadata is not None, f"{type(obj).__name__} without metadata"
    version = obj.metadata.resource_version
    assert version is not None, f"{type(obj).__name__} without a resourceVersion"
    return version


def as_sent(model: type[_Model], body: Mapping[str, Any]) -> _Model:
    """`body` for a client call whose signature asks for a `model`.

    The client sends a dict body as it is (its serializer passes dicts through), where a model would parse and
    rewrite fields (times, values a test means to be invalid): a test sends exactly the JSON it means."""
    del model  # names the type the call asks for; the body stays the JSON it is
    return cast(_Model, body)  # a Mapping at run time, which the client serializes unchanged
