"""A backend's journal shared by two agent instances (a rolling update): each sees what the other wrote, and no
write lands in a file the other replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends import journal as journal_module
from backends.journal import Journal


def opened(path: Path) -> Journal:
    journal = Journal(path, durable=False)
    journal.load()
    return journal


def test_two_instances_see_each_others_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_module, "_COMPACT_SLACK", 2)
    path = tmp_path / "vfio-ledger.json"
    old, new = opened(path), opened(path)
    old.put("a/gpu-0", {"bound": True})
    assert new.get("a/gpu-0") == {"bound": True}, "an entry the other instance wrote"
    new.remove("a/gpu-0")
    assert old.get("a/gpu-0") is None, "an entry the other instance removed"
    for n in range(6):  # the new instance rewrites the file (compaction) under the old one's open descriptor
        new.put(f"b/vf-{n}", {"bound": True})
        new.remove(f"b/vf-{n}")
    old.put("c/gpu-1", {"bound": False})
    assert new.get("c/gpu-1") == {"bound": False}, "the old instance appended to the file that is there now"
    assert dict(opened(path)) == {"c/gpu-1": {"bound": False}}
    third = opened(path)  # a third instance starting rewrites the file again
    third.put("d/gpu-2", {"bound": True})
    assert dict(old) == dict(new) == {"c/gpu-1": {"bound": False}, "d/gpu-2": {"bound": True}}
    for journal in (old, new, third):
        journal.close()


def test_a_torn_line_is_cut_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "j.json"
    journal = opened(path)
    journal.put("a", {"x": 1})
    with path.open("ab") as f:
        f.write(b'{"put":["b",{"x"')  # a crash of another instance in the middle of its append
    journal.put("c", {"x": 3})
    assert dict(opened(path)) == {"a": {"x": 1}, "c": {"x": 3}}
    assert opened(path).problems == []
    journal.close()
