"""Failures nobody foresaw, in an operator's words: a backend's or a plugin's bug, an operating-system error, an API
server that cannot be reached. Never Python's exception names or errno texts; a plugin's own words stay."""

from __future__ import annotations

import errno
import re

import aiohttp
import pytest

from agent.kube.unreachable import why_unreachable
from agent.unexpected import unexpected
from backends.contract import PrepareError
from tests.support.agent_env import free_port
from tests.support.timing import scaled

PYTHON_INTERNALS = re.compile(r"\b\w*(?:Error|Exception)\b|Traceback|Errno|\bNone\b")


class LicenceTrouble(Exception):
    """A plugin's own exception."""


@pytest.mark.parametrize(("error", "words"), [
    (PrepareError("gpu-0: busy"), "gpu-0: busy"),
    (ModuleNotFoundError("No module named 'acme'", name="acme"), "module acme is not installed"),
    (PermissionError(errno.EACCES, "Permission denied", "/sys/bus/pci/drivers/nvidia/unbind"),
     "permission denied: /sys/bus/pci/drivers/nvidia/unbind"),
    (OSError(errno.ENAMETOOLONG, "File name too long"), "file name too long"),
    (TimeoutError(), "it timed out"),
    (RuntimeError("licence server unreachable"), "licence server unreachable"),
    (LicenceTrouble("licence expired"), "licence expired"),
    (KeyError("uid"), "it failed unforeseen (a bug: the log has where)"),
    (TypeError("'NoneType' object is not subscriptable"), "it failed unforeseen (a bug: the log has where)"),
    (ValueError("invalid literal for int() with base 10: 'x'"), "it failed unforeseen (a bug: the log has where)"),
    (RuntimeError(), "it failed unforeseen (a bug: the log has where)"),
])  # fmt: skip
def test_an_unforeseen_failure_is_worded_for_the_operator(error: BaseException, words: str) -> None:
    assert unexpected(error) == words
    assert not PYTHON_INTERNALS.search(words)


async def test_an_api_server_that_cannot_be_reached_is_worded_for_the_operator() -> None:
    port = free_port()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await session.get(f"http://127.0.0.1:{port}/api", timeout=aiohttp.ClientTimeout(total=scaled(5)))
    assert why_unreachable(refused.value) == (f"cannot connect to the API server at 127.0.0.1:{port}: connection "
                                              "refused (nothing listens there)")
    for error, words in [(TimeoutError(), "no answer from the API server in time"),
                         (aiohttp.ServerDisconnectedError(), "the API server closed the connection before it answered"),
                         (aiohttp.ClientPayloadError("Response payload is not completed"),
                          "the API server's answer was cut short"),
                         (ValueError("Expecting value: line 1 column 1 (char 0)"),
                          "the API server's answer cannot be read"),
                         (OSError(errno.ENETUNREACH, "Network is unreachable"), "the network is unreachable"),
                         (KeyError("x"), "the request could not be sent")]:
        assert why_unreachable(error) == words
        assert not PYTHON_INTERNALS.search(words)
