"""The URL paths and field selectors of the agent's API requests, for arbitrary namespaces, names, node and driver
names: either the request is refused before anything is sent, or what goes on the wire splits back into exactly
the values given, each a valid name of its kind, with no `.`, `..` or empty segment for the HTTP client to fold."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

import pytest
import yarl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes.aio import client
from kubernetes.aio.client.rest import RESTResponse

from agent.kube.client import KubeClient, KubeError
from agent.kube.names import is_dns_label, is_dns_subdomain, is_driver_name, is_node_name

HOSTILE = [
    "../../../../tmp/x-ns", "default/resourceclaims/x/../../../../../api/v1/nodes/x-node#", "/etc/x", "../../x",
    "%2F", "%2e%2e", "..", ".", "", "a\x00b", "a" * 300, "def\u0430ult", "a\uff0fb", "a\u2215b", "x?watch=1",
    "a,spec.driver=b", "a=b", "a!=b", "A", "a.", "-a", "a..b", "\u212a.example.com",
]
SOUND = ["default", "a", "kube-system", "gpu.nvidia.com", "a.b-c", "x" * 63, ".".join(["y" * 63] * 4)[:253]]

segments = st.one_of(
    st.sampled_from(HOSTILE + SOUND),
    st.text(max_size=70),
    st.text(alphabet="az09.-/%#?=,!", max_size=20),
    st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,70}[a-z0-9])?", fullmatch=True),
)
# Python's text for the names the agent's messages must never show (its exception classes, a traceback).
INTERNALS = re.compile(r"\b\w+(Error|Exception)\b|Traceback|_Sent")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


class _Sent(Exception):
    """The request reached the HTTP client: the test stops it there."""


@dataclass
class Wire:
    """A KubeClient whose requests stop at the HTTP client, which would send the URLs in `sent`."""

    kube: KubeClient
    runner: asyncio.Runner
    sent: list[yarl.URL] = field(default_factory=list)

    def call(self, make: Callable[[KubeClient], Awaitable[Any]]) -> yarl.URL | None:
        """The URL the call would have sent, or None when it was refused before; what it raised otherwise."""
        self.sent.clear()
        try:
            self.runner.run(make(self.kube))  # type: ignore[arg-type]
        except KubeError as e:
            if not self.sent:
                # The refused value is shown quoted; the words around it must be the domain's.
                assert not INTERNALS.search(QUOTED.sub('""', str(e))), str(e)
                return None
        (url,) = self.sent
        return url


@contextmanager
def wire() -> Iterator[Wire]:
    with asyncio.Runner() as runner:
        configuration = client.Configuration()
        configuration.host = "https://127.0.0.1:1"
        api = client.ApiClient(configuration)
        result = Wire(KubeClient(api), runner)

        async def call_api(method: str, url: str, header_params: object = None, body: object = None,
                           post_params: object = None, _request_timeout: object = None,
                           _preload_content: bool = True) -> RESTResponse:
            result.sent.append(yarl.URL(url))  # as the client's aiohttp session makes it, folding `..` and all
            raise _Sent

        api.call_api = call_api  # type: ignore[method-assign]
        try:
            yield result
        finally:
            runner.run(api.close())


def _split(url: yarl.URL) -> list[str]:
    """The path's segments, unescaped; each must be escaped in full (nothing kept but unreserved characters)."""
    parts = url.raw_path.split("/")
    assert parts[0] == "", url
    values = [unquote(p) for p in parts[1:]]
    assert [quote(v, safe="") for v in values] == parts[1:], url
    assert not {".", "..", ""} & set(values), url
    return values


async def _watch(kube: KubeClient, node: str, driver: str) -> None:
    async for _ in kube.watch_slices(node, driver, "1", 10):
        break


def _object_calls(namespace: str, name: str) -> list[tuple[Callable[[KubeClient], Awaitable[Any]], list[str]]]:
    """Each call of the client that names an object, and the segments its path must have."""
    claim = ["apis", "resource.k8s.io", "v1", "namespaces", namespace, "resourceclaims", name]
    events = ["apis", "events.k8s.io", "v1", "namespaces", namespace, "events"]
    slices = ["apis", "resource.k8s.io", "v1", "resourceslices"]
    return [
        (lambda k: k.get_claim(namespace, name), claim),
        (lambda k: k.apply_claim_status(namespace, name, {}, "gpu.nvidia.com", 1.0), [*claim, "status"]),
        (lambda k: k.create_event(namespace, {"metadata": {"name": name}}, 1.0), events),
        (lambda k: k.patch_event(namespace, name, {}, 1.0), [*events, name]),
        (lambda k: k.replace_slice(name, {}), [*slices, name]),
        (lambda k: k.delete_slice(name), [*slices, name]),
        (lambda k: k.get_node_uid(name), ["api", "v1", "nodes", name]),
    ]


def test_every_request_path_names_its_object_or_is_not_sent() -> None:
    tally = {"examples": 0, "sent": 0, "refused": 0}
    with wire() as w:

        @settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(segments, segments)
        def check(namespace: str, name: str) -> None:
            tally["examples"] += 1
            for make, expected in _object_calls(namespace, name):
                url = w.call(make)
                if url is None:
                    tally["refused"] += 1
                    continue
                tally["sent"] += 1
                assert _split(url) == expected, (expected, url)
                if "namespaces" in expected:
                    assert is_dns_label(namespace), url
                assert is_dns_subdomain(expected[-1] if expected[-1] != "status" else name), url

        check()
    print(f"object paths: {tally}")
    assert tally["sent"] >= 1000 and tally["refused"] >= 1000, tally


def test_the_slice_selector_says_only_this_node_and_driver_or_is_not_sent() -> None:
    tally = {"examples": 0, "sent": 0, "refused": 0}
    with wire() as w:

        @settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(segments, segments)
        def check(node: str, driver: str) -> None:
            tally["examples"] += 1
            for make in (lambda k: k.list_slices(node, driver), lambda k: _watch(k, node, driver)):
                url = w.call(make)
                if url is None:
                    tally["refused"] += 1
                    continue
                tally["sent"] += 1
                assert _split(url) == ["apis", "resource.k8s.io", "v1", "resourceslices"], url
                terms = url.query["fieldSelector"].split(",")
                assert terms == [f"spec.nodeName={node}", f"spec.driver={driver}"], url
                assert is_node_name(node) and is_driver_name(driver), url

        check()
    print(f"slice selectors: {tally}")
    assert tally["sent"] >= 150 and tally["refused"] >= 300, tally


@pytest.mark.parametrize("value", HOSTILE)
def test_each_hostile_value_is_refused_wherever_it_goes(value: str) -> None:
    with wire() as w:
        for make, _ in _object_calls(value, value):
            assert w.call(make) is None
        assert w.call(lambda k: k.get_claim(value, "claim")) is None
        assert w.call(lambda k: k.get_claim("default", value)) is None
        # A driver name is a DNS subdomain once lower-cased, as the server checks it: "A" is one.
        assert (w.call(lambda k: k.list_slices(value, "gpu.nvidia.com")) is None) == (not is_node_name(value))
        assert (w.call(lambda k: k.list_slices("node-a", value)) is None) == (not is_driver_name(value))


def test_a_refusal_names_the_field_and_its_rule() -> None:
    with wire() as w:
        with pytest.raises(KubeError) as refused:
            w.runner.run(w.kube.get_claim("../../x", "c"))
        assert not w.sent
        assert str(refused.value) == ('ResourceClaim namespace "../../x" is not valid, so no request was sent: it must '
                                      "be a DNS label: 1-63 lower-case letters, digits or '-', alphanumeric at both "
                                      "ends")
        with pytest.raises(KubeError) as refused:
            w.runner.run(w.kube.list_slices("node-a", "gpu,spec.nodeName=other"))
        assert str(refused.value).startswith('driver name "gpu,spec.nodeName=other" is not valid')
        with pytest.raises(KubeError) as refused:
            w.runner.run(w.kube.get_node_uid("n\u0430" * 100))
        assert str(refused.value).startswith('Node name "' + "n\\u0430" * 40 + '"… is not valid')
