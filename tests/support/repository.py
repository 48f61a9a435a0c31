"""Where the tests find files: the repository's root, for tests that read its sources, docs and manifests, and this
folder, for the data the tests share (the conformance kit's broken backends and extra node profiles)."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parent.parent
