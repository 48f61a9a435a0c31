"""The device metadata files of one driver on disk: written atomically, re-created when lost, removed with the claim.

What goes into them is worked out in agent/claims/metadata.py; this module owns the files: the host files in
`<plugin data folder>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json` (0644, folders 0755) and the
CDI specs `<driver>_metadata_<claim UID>_<request>.json` in the CDI folder. Every call but `check` and `prepared`
blocks on the file system (the preparer runs them in a worker thread) and raises MetadataError with a message for
the claim.

Removing what is not there counts as removed: a file or folder already gone, or one whose name the file system
could never hold, so that a claim's unprepare and the roll-back of a failed prepare always complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Collection, Sequence
from dataclasses import replace
from pathlib import Path

from agent.claims.metadata import (
    CDI_CLASS,
    DIRECTORY,
    FILE,
    NAME_MAX,
    PATH_MAX,
    ClaimIdentity,
    MetadataError,
    RequestFile,
    check_names,
    claim_directory,
    decode_stream,
    is_metadata_id,
    request_files,
    spec_file_prefix,
    spec_for,
    transient_id,
    with_metadata_ids,
)
from agent.claims.read import ClaimAllocation
from agent.claims.records import ClaimRecord, DeviceRecord
from cdi.names import CdiNameError
from cdi.spec import CdiSpecError
from cdi.store import SpecStore, write_atomically

__all__ = ["MetadataFiles"]


class MetadataFiles:
    """One driver's device metadata files and their CDI specs. `enabled`: new claims get them (the `device_metadata`
    setting); files of claims prepared while it was on are re-created and removed either way."""

    def __init__(self, driver: str, pool: str, plugin_dir: Path, cdi_dir: Path, *, enabled: bool) -> None:
        self.driver = driver
        self.pool = pool
        self.plugin_dir = Path(plugin_dir).absolute()
        self.enabled = enabled
        self._name_max, self._path_max = _limits(self.root)
        self._store: SpecStore | None = None
        self._problem = ""
        try:
            self._store = SpecStore(cdi_dir, driver, CDI_CLASS, file_prefix=spec_file_prefix(driver))
        except CdiNameError as e:  # a driver name starting with a digit names no CDI vendor
            self._problem = f"driver name {driver} cannot name a CDI kind for device metadata: {e}"

    @property
    def root(self) -> Path:
        return self.plugin_dir / DIRECTORY

    # --- what the preparer calls ------------------------------------------------------------------------

    def check(self, allocation: ClaimAllocation) -> None:
        """Pure: MetadataError when the claim's files cannot be made, before anything is written (a name the file
        system cannot hold, a request or pod claim name that is no path part)."""
        ref = allocation.ref
        claim = ClaimIdentity(ref.uid, ref.namespace, ref.name, allocation.pod_claim_name)
        check_names(self.driver, claim, [d.request for d in allocation.devices], str(self.plugin_dir),
                    name_max=self._name_max, path_max=self._path_max)

    def prepared(self, allocation: ClaimAllocation, records: Sequence[DeviceRecord]
                 ) -> tuple[tuple[DeviceRecord, ...], ClaimIdentity, list[RequestFile]]:
        """Pure: the records with the metadata CDI IDs added, the claim, and the files to write for it."""
        ref = allocation.ref
        claim = ClaimIdentity(ref.uid, ref.namespace, ref.name, allocation.pod_claim_name)
        allocated = [(d.request, d.device, d.share_id) for d in allocation.devices]
        files = request_files(self.driver, self.pool, claim, allocated, records, str(self.plugin_dir))
        return with_metadata_ids(records, allocated, files), claim, files

    def ensure(self, record: ClaimRecord, allocation: ClaimAllocation | None) -> list[str]:
        """Re-create what is lost of a completed claim's files: everything from the claim when the kubelet asks
        again (`allocation`), else (at start) the specs from the host files. The requests re-created."""
        requests = self._requests(record)
        if not requests:
            return []
        try:
            if allocation is None:
                return self.restore_specs(record.uid, record.namespace, record.name, requests)
            _, claim, files = self.prepared(allocation, record.devices)
            return self.write_missing(claim, [f for f in files if f.request in requests])
        except (OSError, CdiSpecError, CdiNameError) as e:
            raise MetadataError(f"cannot re-create the device metadata: {_why(e)}") from None

    def release(self, record: ClaimRecord) -> None:
        """Remove what a claim may have: the files its record names, or, for a prepare cut short or a claim known
        from its CDI spec alone, whatever carries its UID."""
        try:
            if record.state == "started" or record.recovered:
                self.remove(record.uid, record.namespace, record.name, None)
            elif requests := self._requests(record):
                self.remove(record.uid, record.namespace, record.name, requests)
        except OSError as e:
            raise MetadataError(_why(e)) from None

    def _requests(self, record: ClaimRecord) -> list[str]:
        prefix = f"{record.uid}_"
        return [i.partition("=")[2].removeprefix(prefix) for d in record.devices for i in d.cdi_ids
                if is_metadata_id(self.driver, i)]

    # --- the files ---------------------------------------------------------------------------------------

    def write(self, claim: ClaimIdentity, files: Sequence[RequestFile]) -> None:
        """Write each request's file, then its CDI spec; on a failure, remove what this claim has, then raise."""
        store = self._specs()
        try:
            for f in files:
                _write_atomically(self.plugin_dir / f.relative_path, f.content)
                store.write(transient_id(claim.uid, f.request), f.spec)
        except (OSError, CdiSpecError, CdiNameError) as e:
            with contextlib.suppress(OSError, MetadataError):
                self.remove(claim.uid, claim.namespace, claim.name, [f.request for f in files])
            raise MetadataError(f"cannot write the device metadata: {_why(e)}") from None

    def write_missing(self, claim: ClaimIdentity, files: Sequence[RequestFile]) -> list[str]:
        """Write the files and specs that are gone (a wiped plugin folder, the CDI tmpfs emptied) or that another claim
        of the same name wrote since, leaving the others as they are; the requests whose files were re-created."""
        store = self._specs()
        restored = []
        for f in files:
            host, identifier = self.plugin_dir / f.relative_path, transient_id(claim.uid, f.request)
            if self._written_for(host) != claim.uid:  # gone, or another claim's of the same name since
                _write_atomically(host, f.content)
                restored.append(f.request)
            if not store.exists(identifier):
                store.write(identifier, f.spec)
                restored.append(f.request)
        return list(dict.fromkeys(restored))

    def readopted(self, allocation: ClaimAllocation, records: Sequence[DeviceRecord]) -> tuple[DeviceRecord, ...]:
        """The records of a claim known from its CDI spec alone (its journal records lost, the devices' facts with
        them), with the metadata CDI IDs of the requests whose host file, written for this claim, is still there:
        those files are kept; no file is written again without the facts."""
        try:
            with_ids, claim, files = self.prepared(allocation, records)
        except MetadataError:
            return tuple(records)  # a claim no file could be made for had none
        kept = {f.cdi_id for f in files if self._written_for(self.plugin_dir / f.relative_path) == claim.uid}
        return tuple(replace(r, cdi_ids=tuple(i for i in r.cdi_ids if not is_metadata_id(self.driver, i) or i in kept))
                     for r in with_ids)

    def restore_specs(self, uid: str, namespace: str, name: str, requests: Sequence[str]) -> list[str]:
        """Re-create the lost CDI specs of a claim from its host files (all a restart has without the claim); the
        requests whose spec came back. A host file that is gone too is re-created at the kubelet's next prepare."""
        store = self._specs()
        restored = []
        for request in requests:
            if store.exists(transient_id(uid, request)):
                continue
            path = self.root / f"{namespace}_{name}" / request / FILE
            try:
                found = decode_stream(path.read_bytes())
            except (OSError, MetadataError):
                continue
            pod_claim_name = found.get("podClaimName")
            claim = ClaimIdentity(uid, namespace, name, pod_claim_name if isinstance(pod_claim_name, str) else None)
            store.write(transient_id(uid, request), spec_for(self.driver, claim, request, str(path)))
            restored.append(request)
        return restored

    # --- unprepare -------------------------------------------------------------------------------------

    def remove(self, uid: str, namespace: str, name: str, requests: Sequence[str] | None) -> None:
        """Remove a claim's specs and host files. `requests` None: not known (a prepare cut short, a claim known
        from its CDI spec alone), so every spec of the claim UID goes, and with no name, every host folder whose
        file names this UID. Files another claim of the same name wrote meanwhile stay; what is not there counts
        as removed."""
        store = self._specs()
        if requests is None:
            prefix = f"{uid}_"
            ids = [i for i in store.list_ids() if i.startswith(prefix)]
        else:
            ids = [transient_id(uid, r) for r in requests]
        for identifier in ids:
            with contextlib.suppress(CdiNameError):  # no spec file can have that name: none was written
                store.delete(identifier)
        folders = [self.plugin_dir / claim_directory(namespace, name)] if name else self._folders()
        for folder in folders:
            self._remove_claim_folder(folder, uid)

    def sweep(self, keep: Collection[str]) -> list[str]:
        """At start: remove the specs and host files of claims whose UID is not in `keep` (the checkpoint's claims),
        and temporary files a crash left; the UIDs whose files were removed. A file that does not tell its claim is
        left alone."""
        store = self._specs()
        removed = {i.partition("_")[0] for i in store.list_ids() if i.partition("_")[0] not in keep}
        store.sweep([i for i in store.list_ids() if i.partition("_")[0] in keep])
        for folder in self._folders():
            for request in [e for e in folder.iterdir() if e.is_dir()]:
                for temp in request.glob(f".{FILE}.*.tmp"):
                    temp.unlink(missing_ok=True)
                uid = self._written_for(request / FILE)
                if uid is not None and uid not in keep:
                    _remove_tree(request)
                    removed.add(uid)
            with contextlib.suppress(OSError):  # not empty: files of claims kept
                folder.rmdir()
        return sorted(removed)

    def _remove_claim_folder(self, folder: Path, uid: str) -> None:
        try:
            requests = [e for e in folder.iterdir() if e.is_dir()]
        except OSError as e:
            if _never_there(e):
                return
            if e.errno != errno.ENOTDIR:
                raise
            folder.unlink(missing_ok=True)
            return
        for request in requests:
            if self._written_for(request / FILE) in (uid, None):
                _remove_tree(request)
        with contextlib.suppress(OSError):  # not empty: another claim's files
            folder.rmdir()

    @staticmethod
    def _written_for(path: Path) -> str | None:
        """The claim UID a file was written for; None when it cannot be told (gone, torn, unreadable)."""
        try:
            uid = decode_stream(path.read_bytes()).get("metadata", {}).get("uid")
        except (OSError, MetadataError, AttributeError):
            return None
        return uid if isinstance(uid, str) else None

    def _folders(self) -> list[Path]:
        try:
            return [e for e in self.root.iterdir() if e.is_dir()]
        except FileNotFoundError:
            return []

    def _specs(self) -> SpecStore:
        if self._store is None:
            raise MetadataError(self._problem)
        return self._store


def _remove_tree(folder: Path) -> None:
    """Remove a folder and what it holds; one already gone (a concurrent sweep, an operator) counts as removed."""
    try:
        shutil.rmtree(folder)
    except OSError as e:
        if not _never_there(e):
            raise


def _never_there(e: OSError) -> bool:
    """Whether an error says the file is not there: gone, or a name the file system cannot hold (never made)."""
    return e.errno in (errno.ENOENT, errno.ENAMETOOLONG)


def _why(e: Exception) -> str:
    """What went wrong, in words for the claim: the file and the system's reason, without the error number."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def _limits(folder: Path) -> tuple[int, int]:
    """The longest file name and path (bytes) of the file system that holds `folder` (or will: the nearest folder
    that exists), or Linux's usual limits when it does not say."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):
        return NAME_MAX, PATH_MAX
    return (name_max if name_max > 0 else NAME_MAX), (path_max if path_max > 0 else PATH_MAX)


def _write_atomically(path: Path, content: bytes) -> None:
    """Replace `path` with `content` (0644) so a reader sees the old file or the new one, never a part."""
    _make_folders(path.parent)
    write_atomically(path, content, prefix=f".{path.name}.")


def _make_folders(folder: Path) -> None:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        with contextlib.suppress(FileExistsError):
            f.mkdir()
        os.chmod(f, 0o755)  # mkdir's mode is filtered by the umask
