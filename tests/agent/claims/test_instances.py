"""Which agent instances are alive on a node: a lock file each, held for the life of the process; two instances
share the state only in rolling-update mode; a started record is rolled back only once its instance is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.claims.checkpoint import Checkpoint
from agent.claims.collaborators import ClaimMemory, ClaimSource, DriverDevices, InstanceGuard, Reporting
from agent.claims.instances import InstanceError, Instances
from agent.claims.preparer import Preparer
from agent.claims.recovery import recover
from agent.logs import get_logger
from cdi.store import SpecStore

POD_A, POD_B = "3f8e4c1a-5b2d-4e6f-8a9b-0c1d2e3f4a5b", "7c1d2e3f-4a5b-4e6f-8a9b-3f8e4c1a5b2d"
BOOT = "11111111-1111-1111-1111-111111111111"


@contextmanager
def holder(state: Path, pod_uid: str | None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Another agent instance: a process that registers and waits; with its instance id."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from agent.claims.instances import Instances
        me = Instances(Path({str(state)!r})).register({pod_uid!r})
        print(me.id, flush=True)
        sys.stdin.read()
    """)
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as process:
        assert process.stdout is not None
        try:
            yield process, process.stdout.readline().strip()
        finally:
            process.kill()
            process.wait()


class Undoing:
    """A backend whose unprepare always works."""

    async def unprepare(self, claim: object, prepared: object) -> None:
        return None


def test_an_instance_is_alive_while_its_process_lives_however_it_ends(scratch: Path) -> None:
    with holder(scratch, POD_A) as (other, instance):
        me = Instances(scratch).register(POD_B)
        assert me.alive(instance) and me.alive(me.id)
        assert {i.id for i in me.running()} == {instance, me.id}
        assert next(i for i in me.running() if i.id == instance).pid == other.pid
        other.send_signal(signal.SIGKILL)
        other.wait()
        assert not me.alive(instance), "the kernel dropped its lock"
        assert [i.id for i in me.running()] == [me.id]
        assert not (scratch / "instances" / f"{instance}.lock").exists(), "a dead instance's file is cleaned up"
        assert not me.alive("")
        me.close()
    assert os.listdir(scratch / "instances") == [".register"]


@pytest.mark.parametrize(("first", "second"), [(None, None), (POD_A, None), (None, POD_B)])
def test_two_instances_share_a_state_only_in_rolling_update_mode(scratch: Path, first: str | None,
                                                                  second: str | None) -> None:
    with holder(scratch, first) as (other, _), \
            pytest.raises(InstanceError, match=f"another dra-agent \\(pid {other.pid}.*serves {scratch}"):
        Instances(scratch).register(second)
    Instances(scratch).register(second).close()  # alone again


async def test_recovery_leaves_a_live_instances_prepare_alone_and_rolls_back_a_dead_ones(scratch: Path) -> None:
    journal = scratch / "state/gpu.nvidia.com/checkpoint.journal"
    with holder(scratch / "state", POD_A) as (other, live):
        await _recover_beside(scratch, journal, other, live)


async def _recover_beside(scratch: Path, journal: Path, other: subprocess.Popen[str], live: str) -> None:
    writer = Checkpoint(journal, BOOT, owner=live)
    writer.load()
    writer.start("00000000-0000-0000-0000-000000000001", "ns", "running", (("gpu-0", "nvidia-gpu"),))
    writer.owner = "0123456789abcdef"  # an instance that is gone
    writer.start("00000000-0000-0000-0000-000000000002", "ns", "cut", (("gpu-1", "nvidia-gpu"),))
    writer.close()
    me = Instances(scratch / "state").register(POD_B)
    preparer = Preparer(DriverDevices("gpu.nvidia.com", "node-a", {"nvidia-gpu": Undoing()},  # type: ignore[dict-item]
                                      lambda device: None),
                        ClaimMemory(Checkpoint(journal, BOOT, owner=me.id),
                                    SpecStore(scratch / "cdi", "k8s.gpu.nvidia.com", "claim")),
                        ClaimSource(None),  # type: ignore[arg-type]
                        instances=InstanceGuard(owner_alive=me.alive), reporting=Reporting(get_logger("test")))
    try:
        await recover(preparer)
        assert set(preparer.checkpoint.claims) == {"00000000-0000-0000-0000-000000000001"}
        other.kill()
        other.wait()
        await recover(preparer)
        assert preparer.checkpoint.claims == {}, "rolled back once its instance was gone"
    finally:
        me.close()
        preparer.checkpoint.close()
