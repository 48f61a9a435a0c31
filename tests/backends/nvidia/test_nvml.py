"""NVML's view of the GPUs (`backends.nvidia.nvml`): a GPU that answers an NVML error for a moment, as one in the
middle of a change of driver does, is asked again before discovery leaves it out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from backends.nvidia import nvml
from backends.nvidia.nvml import list_gpus, nvml_session
from simulator.node.node import SimulatedNode


def failing(times: int, index: int, code: int) -> tuple[Callable[[int], Any], list[int]]:
    """nvmlDeviceGetHandleByIndex answering `code` for GPU `index` the first `times` calls; the calls made."""
    real = pynvml.nvmlDeviceGetHandleByIndex
    calls: list[int] = []

    def handle(i: int) -> Any:
        calls.append(i)
        if i == index and calls.count(i) <= times:
            raise pynvml.NVMLError(code)
        return real(i)
    return handle, calls


@pytest.mark.parametrize("times", [1, 3])
def test_a_gpu_that_fails_for_a_moment_is_found(sim_node: Callable[[str], SimulatedNode],
                                                monkeypatch: pytest.MonkeyPatch, times: int) -> None:
    sim_node("gke-n1-t4x2")
    handle, calls = failing(times, 1, pynvml.NVML_ERROR_INVALID_ARGUMENT)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    monkeypatch.setattr(nvml, "_RETRY_PAUSES", (0.0, 0.0, 0.0))
    with nvml_session():
        gpus, problems = list_gpus()
    assert [g.index for g in gpus] == [0, 1] and problems == []
    assert calls.count(1) == times + 1


def test_a_gpu_that_keeps_failing_is_left_out_with_the_reason(sim_node: Callable[[str], SimulatedNode],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    sim_node("gke-n1-t4x2")
    handle, calls = failing(10, 1, pynvml.NVML_ERROR_INVALID_ARGUMENT)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    monkeypatch.setattr(nvml, "_RETRY_PAUSES", (0.0, 0.0, 0.0))
    with nvml_session():
        gpus, problems = list_gpus()
    assert [g.index for g in gpus] == [0]
    assert [p.message for p in problems] == ["GPU 1: nvmlDeviceGetHandleByIndex failed: Invalid Argument; left out"]
    assert calls.count(1) == 4


def test_a_lost_gpu_is_not_asked_again(sim_node: Callable[[str], SimulatedNode],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    sim_node("gke-n1-t4x2")
    handle, calls = failing(10, 0, pynvml.NVML_ERROR_GPU_IS_LOST)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", handle)
    with nvml_session():
        _, problems = list_gpus()
    assert [(p.index, p.lost) for p in problems] == [(0, True)]
    assert calls.count(0) == 1
