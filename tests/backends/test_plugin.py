"""`backends.plugin`, the one module a plugin imports: every name in it is in the plugin guide's table and the
table names nothing else; the optional-member protocols answer as the agent relies on."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import backends.plugin as plugin
from backends.capabilities import records_own_changes
from backends.nvidia.gpu import NvidiaGpuBackend
from backends.nvidia.mig import NvidiaMigBackend
from backends.sriov.backend import SriovNicBackend
from backends.tpu import TpuBackend
from tests.support.repository import ROOT

GUIDE = ROOT / "docs/plugin-guide.md"
SECTION = "## 10. Everything in `backends.plugin`"


def documented() -> list[str]:
    """The names in the first column of the guide's table of `backends.plugin`."""
    section = GUIDE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)


def test_the_guide_documents_every_name_once_and_nothing_else() -> None:
    names = documented()
    assert len(names) == len(set(names)), "a name in the table twice"
    assert set(plugin.__all__) - set(names) == set(), "names plugins can import that the guide does not explain"
    assert set(names) - set(plugin.__all__) == set(), "names the guide lists that backends.plugin does not offer"


def test_every_name_is_there() -> None:
    assert [name for name in plugin.__all__ if name not in vars(plugin)] == []


class Bare:
    """None of the optional members."""


class Declares:
    records_own_changes = True
    config_types = ()
    config_model = plugin.BackendConfig

    async def reconcile(self, held: Mapping[str, Sequence[str]]) -> None:
        return None


class DeclaresFalse:
    records_own_changes = False


class DeclaresTruthy:
    records_own_changes = 1  # not a declaration: only True is


class ReconcileNone:
    reconcile = None


def test_optional_members_are_recognised_by_isinstance() -> None:
    for protocol in (plugin.Reconciles, plugin.RecordsOwnChanges, plugin.HasConfigTypes, plugin.HasConfigModel):
        assert isinstance(Declares(), protocol), protocol
        assert not isinstance(Bare(), protocol), protocol
    assert not isinstance(ReconcileNone(), plugin.Reconciles), "a member set to None is no method"


def test_only_true_declares_records_own_changes() -> None:
    assert records_own_changes(Declares())
    assert isinstance(DeclaresFalse(), plugin.RecordsOwnChanges), "isinstance sees the member, not its value"
    assert not records_own_changes(DeclaresFalse())
    assert not records_own_changes(DeclaresTruthy())
    assert not records_own_changes(Bare())


def test_the_built_in_backends_declare_what_they_do() -> None:
    for backend in (NvidiaGpuBackend(), NvidiaMigBackend(), SriovNicBackend()):
        assert isinstance(backend, plugin.Reconciles) and records_own_changes(backend), backend.name
        assert isinstance(backend, plugin.HasConfigTypes) and backend.config_types, backend.name
    tpu = TpuBackend()  # changes nothing on the node, accepts no claim parameters
    assert records_own_changes(tpu) and isinstance(tpu, plugin.HasConfigModel)
    assert not isinstance(tpu, plugin.Reconciles) and not isinstance(tpu, plugin.HasConfigTypes)
