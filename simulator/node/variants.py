"""Node profiles derived from the built-in ones, for what a built-in profile does not show by itself."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

__all__ = ["in_mig_mode", "with_char_devices"]


def in_mig_mode(base: str, folder: Path, made: Mapping[int, Sequence[Mapping[str, Any]]] | None = None) -> Path:
    """The built-in profile `base` with every GPU in MIG mode, written to `folder` as `<base>-mig.yaml`.

    GPUs start with no MIG device, or with those `made` by an operator, by the position of the GPU entry in the
    profile (an entry with a count stands for that many GPUs, which all get its instances).
    """
    profile = yaml.safe_load((resources.files("simulator.node") / f"profiles/{base}.yaml").read_text())
    profile["name"] = f"{base}-mig"
    profile["description"] = f"{base} with MIG mode enabled on every GPU."
    position = itertools.count()

    def enable(entry: Any) -> None:
        if isinstance(entry, dict):
            if "gpu" in entry:
                spec = entry["gpu"] if isinstance(entry["gpu"], dict) else {"model": entry["gpu"]}
                entry["gpu"] = {**spec, "mig": {"instances": list((made or {}).get(next(position), []))}}
            for value in entry.values():
                enable(value)
        elif isinstance(entry, list):
            for value in entry:
                enable(value)

    enable(profile["root_complexes"])
    path = folder / f"{base}-mig.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def with_char_devices(base: str, folder: Path, **nvidia: Any) -> Path:
    """The profile `base` (a built-in name or a YAML path) with real character devices in its /dev
    (`device_nodes: char`), and its driver settings updated with `nvidia`, written to `folder` as
    `<name>-char.yaml`."""
    builtin = resources.files("simulator.node") / f"profiles/{base}.yaml"
    profile = yaml.safe_load((Path(base) if base.endswith((".yaml", ".yml")) else builtin).read_text())
    profile["name"] = f"{profile['name']}-char"
    profile["device_nodes"] = "char"
    if nvidia:
        profile["nvidia"] = {**profile.get("nvidia", {}), **nvidia}
    path = folder / f"{profile['name']}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path
