"""The CDI spec directory as seen by one kind: atomic writes, reads, deletes and the start-up orphan sweep."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

from cdi.host_root import rooted, unrooted
from cdi.names import (
    MAX_SPEC_FILE_NAME,
    CdiNameError,
    safe_transient_id,
    spec_file_name,
    spec_file_prefix,
    validate_spec,
)
from cdi.spec import CdiSpecError, Spec

SPEC_EXTENSIONS = (".json", ".yaml")
# The runtime's scanner only reads .json and .yaml files, so a half-written temporary file is never seen.
TEMP_SUFFIX = ".tmp"
_YAML_KIND = re.compile(r"""^kind:\s*["']?([^"'\s#]+)""", re.MULTILINE)


def write_atomically(target: Path, data: bytes, *, prefix: str) -> None:
    """Replace `target` with `data`, synced and readable by everyone (0644): a reader (the container runtime, a
    workload) sees the old file or the new one, never a part. The temporary file is `<prefix>…{TEMP_SUFFIX}` in
    the same directory, which must exist."""
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=TEMP_SUFFIX)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o644)  # mkstemp creates 0600; the reader may be another user
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


class SpecStore:
    """Transient spec files `<vendor>-<class>_<id>.json` of one kind in one directory (`file_prefix` replaces the
    `<vendor>-<class>_` part, for files named by another convention, such as the device metadata specs').

    Calls block on the file system and are safe from several threads as long as they name distinct ids.
    Files of other kinds are never touched. With `runtime_root`, the host paths of the specs are written below it
    and read back relative to it (see `cdi.host_root`).
    """

    def __init__(self, directory: Path, vendor: str, cls: str, *, file_prefix: str | None = None,
                 runtime_root: str = "/") -> None:
        self.directory = Path(directory)
        self.runtime_root = runtime_root
        self.vendor = vendor
        self.cls = cls
        self.kind = f"{vendor}/{cls}"
        self._prefix = spec_file_prefix(vendor, cls)  # checks the kind's names either way
        if file_prefix is not None:
            if safe_transient_id(file_prefix) != file_prefix:
                raise CdiNameError(f"spec file prefix {file_prefix!r} is not a plain file name part")
            self._prefix = file_prefix
        self._ensure_directory()

    def path(self, transient_id: str) -> Path:
        """Where the spec `transient_id` lives (CdiNameError for an id unsafe in a file name)."""
        if self._prefix != spec_file_prefix(self.vendor, self.cls):
            name = f"{self._prefix}{safe_transient_id(transient_id)}.json"
            if len(name.encode()) > MAX_SPEC_FILE_NAME:
                raise CdiNameError(f"spec file name {name!r} is longer than {MAX_SPEC_FILE_NAME} bytes")
            return self.directory / name
        return self.directory / spec_file_name(self.vendor, self.cls, transient_id)

    def write(self, transient_id: str, spec: Spec) -> Path:
        """Validate `spec`, then replace the file of `transient_id` atomically; returns its path."""
        spec = rooted(spec, self.runtime_root)
        problems = validate_spec(spec)
        if spec.kind != self.kind:
            problems.insert(0, f"kind {spec.kind!r} is not this directory's kind {self.kind!r}")
        if problems:
            raise CdiSpecError(f"refusing to write CDI spec {transient_id!r}: " + "; ".join(problems))
        target = self.path(transient_id)
        data = spec.to_json(indent=None).encode()  # compact: the C encoder, several times faster
        self._ensure_directory()  # /var/run/cdi is a tmpfs and may have been emptied
        write_atomically(target, data, prefix=target.stem + ".")
        # A YAML spec under the same id would define the same devices at the same priority, and the
        # runtime drops both copies of a conflicting device.
        _unlink(target.with_suffix(".yaml"))
        self._sync_directory()
        return target

    def read(self, transient_id: str) -> Spec | None:
        """The JSON spec of `transient_id`, or None if there is none (CdiSpecError if it does not decode)."""
        try:
            data = self.path(transient_id).read_bytes()
        except FileNotFoundError:
            return None
        return unrooted(Spec.from_json(data), self.runtime_root)

    def exists(self, transient_id: str) -> bool:
        target = self.path(transient_id)
        return any(target.with_suffix(ext).exists() for ext in SPEC_EXTENSIONS)

    def delete(self, transient_id: str) -> bool:
        """Remove the spec of `transient_id` (JSON and YAML); a missing spec is fine. True if one was removed."""
        target = self.path(transient_id)
        removed = [_unlink(target.with_suffix(ext)) for ext in SPEC_EXTENSIONS]
        self._sync_directory()
        return any(removed)

    def list_ids(self) -> list[str]:
        """Ids of this kind's spec files, sorted."""
        return sorted({transient_id for transient_id, _ in self._spec_files()})

    def sweep(self, keep: Collection[str]) -> list[str]:
        """Delete this kind's specs whose id is not in `keep`, and leftover temporary files; returns deleted ids.

        Meant for start-up, before any write: it also removes the temporary file of a write in progress.
        """
        kept = {k.replace("/", "_") for k in keep}
        removed: set[str] = set()
        for transient_id, path in self._spec_files():
            if transient_id not in kept and _unlink(path):
                removed.add(transient_id)
        for entry in self._entries():
            if entry.name.startswith(self._prefix) and entry.name.endswith(TEMP_SUFFIX):
                _unlink(Path(entry.path))
        self._sync_directory()
        return sorted(removed)

    # --- internals ------------------------------------------------------------------------------

    def _ensure_directory(self) -> None:
        try:
            self.directory.mkdir(mode=0o755, parents=True)
        except FileExistsError:
            return
        os.chmod(self.directory, 0o755)  # mkdir's mode is filtered by the umask

    def _sync_directory(self) -> None:
        """Make renames and removals durable (a no-op on tmpfs, not on /etc/cdi)."""
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _entries(self) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(self.directory) as it:
                return [e for e in it if e.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def _spec_files(self) -> Iterator[tuple[str, Path]]:
        """(id, path) of each spec file of this kind: by name, then by the kind inside when it can be read."""
        for entry in self._entries():
            stem, ext = os.path.splitext(entry.name)
            if ext not in SPEC_EXTENSIONS or not stem.startswith(self._prefix):
                continue
            transient_id = stem[len(self._prefix) :]
            try:
                safe_transient_id(transient_id)
            except CdiNameError:
                continue  # not a name this store would write, so not one it may delete
            path = Path(entry.path)
            # Names alone are ambiguous ("a-b-c_x" is vendor a, class b-c or vendor a-b, class c, and
            # class "claim_x" starts like class "claim"), so the kind written in the file decides.
            if self._declared_kind(path) in (self.kind, None):
                yield transient_id, path

    def _declared_kind(self, path: Path) -> str | None:
        """The `kind` a spec file declares, or None when it cannot be told (unreadable or malformed)."""
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return None
        if path.suffix == ".json":
            try:
                kind = json.loads(text).get("kind")
            except (ValueError, AttributeError):
                return None
            return kind if isinstance(kind, str) else None
        # YAML: no parser in the standard library; a top-level "kind:" line is how specs are written.
        found = _YAML_KIND.search(text)
        return found.group(1) if found else None


def _unlink(path: Path) -> bool:
    """Remove `path`; False if it was already gone."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
