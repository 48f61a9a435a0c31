"""The docs say what the product has: every setting of the settings model and every flag of `dra-agent --help` is in
docs/configuration.md, every option of every command is in the docs, and every file of the repository the docs
(and the README) name exists. (That every metric the docs name is served, and every metric served is named, is
checked against a running agent in tests/end_to_end/test_run_metrics.py.)"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from agent.commands.cli import build_parser
from agent.settings import Settings
from tests.support.repository import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIGURATION = ROOT / "docs" / "configuration.md"
# The repository's folders a doc names files in; a name with a placeholder (`<name>`, `*`, `...`) is no file.
TOP = ("agent", "backends", "cdi", "cluster", "deploy", "docs", "examples", "scripts", "simulator", "systemd",
       "tests", "bench", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*[\w/])")


def all_text() -> str:
    return "\n".join(p.read_text() for p in [*DOCS, ROOT / "README.md"])


def settings_table() -> str:
    text = CONFIGURATION.read_text()
    return text.split("## Settings", 1)[1].split("\n## ", 1)[0]


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_setting_is_in_the_settings_table() -> None:
    table = settings_table()
    missing = [name for name in Settings.model_fields if f"`{name}`" not in table]
    assert missing == [], f"docs/configuration.md's settings table lacks {missing}"


def test_every_flag_of_a_setting_is_in_the_settings_table() -> None:
    table = settings_table()
    missing = []
    for name, command in commands().items():
        for action in command._actions:
            if action.dest in Settings.model_fields or action.dest == "config":
                for flag in action.option_strings:
                    if flag.startswith("--") and f"`{flag}`" not in table and f"`{flag} " not in table:
                        missing.append(f"{name} {flag}")
    assert missing == [], f"docs/configuration.md's settings table lacks the flags {sorted(set(missing))}"


def named(option: str, text: str) -> bool:
    """Whether the text names an option (`-o` as a word of its own, not inside another)."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_every_option_of_every_command_is_in_the_docs() -> None:
    text = all_text()
    missing = [f"{name} {action.option_strings}" for name, command in commands().items()
               for action in command._actions
               if "--help" not in action.option_strings and not any(named(o, text) for o in action.option_strings)]
    assert missing == [], f"options no doc names: {missing}"


def exists(name: str) -> bool:
    """A file or folder of the repository, or a name in a module (`tests/agent_env.agent_in_process`)."""
    module, dot, _ = name.partition(".")
    return (ROOT / name).exists() or (bool(dot) and (ROOT / f"{module}.py").exists())


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc: Path) -> None:
    paths = {m for m in PATH.findall(doc.read_text()) if not re.search(r"[<>*]|\.\.\.", m)}
    missing = sorted(m for m in paths if not exists(m))
    assert missing == [], f"{doc.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: p.name)
def test_every_doc_a_doc_links_exists(doc: Path) -> None:
    links = re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", doc.read_text())
    missing = sorted({link for link in links if not (doc.parent / link).exists()})
    assert missing == [], f"{doc.name} links to docs that do not exist: {missing}"
