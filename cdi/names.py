"""CDI naming rules: vendor/class/device names, qualified device names, spec file names, spec validation."""

from __future__ import annotations

import re

from cdi.interface_names import kernel_name_problem
from cdi.spec import ContainerEdits, Spec, minimum_version, parse_version

# SPEC.md: the vendor is a DNS subdomain, the class at most 63 characters.
MAX_VENDOR_LENGTH = 253
MAX_CLASS_LENGTH = 63
# NAME_MAX is 255 bytes; the rest is kept for the temporary name used while writing.
MAX_SPEC_FILE_NAME = 255 - 16

HOOK_NAMES = frozenset(
    # prestart is deprecated in the OCI runtime spec, but the CDI validator still accepts it.
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
DEVICE_NODE_TYPES = frozenset({"b", "c", "u", "p"})
UINT32_MAX = 2**32 - 1
INT64_MAX = 2**63 - 1

_KIND_PART = re.compile(r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_TRANSIENT_ID = re.compile(r"[A-Za-z0-9._-]+")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KIND_PART_RULE = "letters, digits, '_', '-' and '.', starting with a letter and ending with a letter or digit"
_DEVICE_RULE = "letters, digits, '_', '-', '.' and ':', starting and ending with a letter or digit"


class CdiNameError(ValueError):
    """A CDI name (vendor, class, device, qualified name or transient spec id) that breaks the naming rules."""


def _vendor_problem(vendor: str) -> str | None:
    if not _KIND_PART.fullmatch(vendor):
        return f"vendor {vendor!r} is invalid: allowed are {_KIND_PART_RULE}"
    if len(vendor) > MAX_VENDOR_LENGTH:
        return f"vendor {vendor!r} is longer than {MAX_VENDOR_LENGTH} characters"
    return None


def _class_problem(cls: str) -> str | None:
    if not _KIND_PART.fullmatch(cls):
        return f"class {cls!r} is invalid: allowed are {_KIND_PART_RULE}"
    if len(cls) > MAX_CLASS_LENGTH:
        return f"class {cls!r} is longer than {MAX_CLASS_LENGTH} characters"
    return None


def _device_problem(name: str) -> str | None:
    if not _DEVICE.fullmatch(name):
        return f"device name {name!r} is invalid: allowed are {_DEVICE_RULE}"
    return None


def is_valid_vendor(vendor: str) -> bool:
    return _vendor_problem(vendor) is None


def is_valid_class(cls: str) -> bool:
    return _class_problem(cls) is None


def is_valid_device_name(name: str) -> bool:
    return _device_problem(name) is None


def parse_kind(kind: str) -> tuple[str, str]:
    """Split `vendor/class` into its parts, raising CdiNameError naming the wrong one."""
    vendor, slash, cls = kind.partition("/")
    if not slash:
        raise CdiNameError(f"kind {kind!r} has no '/': expected <vendor>/<class>")
    problem = _vendor_problem(vendor) or _class_problem(cls)
    if problem:
        raise CdiNameError(f"kind {kind!r}: {problem}")
    return vendor, cls


def parse_qualified_name(name: str) -> tuple[str, str, str]:
    """Split `vendor/class=name` into (vendor, class, name), raising CdiNameError naming the wrong part."""
    if name.startswith("/"):
        raise CdiNameError(f"{name!r} is a device path, not a CDI name <vendor>/<class>=<name>")
    kind, equals, device = name.partition("=")
    if not equals:
        raise CdiNameError(f"{name!r} has no '=': expected <vendor>/<class>=<name>")
    try:
        vendor, cls = parse_kind(kind)
    except CdiNameError as e:
        raise CdiNameError(f"CDI name {name!r}: {e}") from None
    problem = _device_problem(device)
    if problem:
        raise CdiNameError(f"CDI name {name!r}: {problem}")
    return vendor, cls, device


def qualified_name(kind: str, device: str) -> str:
    """`kind=device`, the fully-qualified CDI device name handed to the kubelet."""
    parse_kind(kind)
    problem = _device_problem(device)
    if problem:
        raise CdiNameError(problem)
    return f"{kind}={device}"


def safe_transient_id(transient_id: str) -> str:
    """The id as it appears in a spec file name ('/' becomes '_'), or CdiNameError if it is unsafe there."""
    safe = transient_id.replace("/", "_")
    # '..' is refused anywhere, not only as a whole name, so no id ever reads as a parent directory.
    if not _TRANSIENT_ID.fullmatch(safe) or ".." in safe:
        raise CdiNameError(f"transient spec id {transient_id!r} is invalid: allowed are letters, digits, '.', '_', '-'")
    return safe


def spec_file_prefix(vendor: str, cls: str) -> str:
    """`<vendor>-<class>_`, what every transient spec file name of this kind starts with."""
    problem = _vendor_problem(vendor) or _class_problem(cls)
    if problem:
        raise CdiNameError(problem)
    return f"{vendor}-{cls}_"


def spec_file_name(vendor: str, cls: str, transient_id: str, extension: str = ".json") -> str:
    """`<vendor>-<class>_<id>.json`: the file name of the transient spec `transient_id` of this kind."""
    if extension not in (".json", ".yaml"):
        raise CdiNameError(f"spec file extension {extension!r} is not .json or .yaml")
    name = f"{spec_file_prefix(vendor, cls)}{safe_transient_id(transient_id)}{extension}"
    if len(name.encode()) > MAX_SPEC_FILE_NAME:
        raise CdiNameError(f"spec file name {name!r} is longer than {MAX_SPEC_FILE_NAME} bytes")
    return name


# --- spec validation --------------------------------------------------------------------------


def _absolute(path: str) -> bool:
    return path.startswith("/") and "\0" not in path


def _env_problems(env: tuple[str, ...], where: str) -> list[str]:
    out = []
    for i, entry in enumerate(env):
        key, equals, value = entry.partition("=")
        if not equals or not _ENV_KEY.fullmatch(key) or "\0" in value:
            out.append(f"{where}[{i}] {entry!r} is not KEY=VALUE with KEY of letters, digits and '_'")
    return out


def _in_range(value: int | None, low: int, high: int) -> bool:
    return value is None or low <= value <= high


def _edits_problems(edits: ContainerEdits, where: str) -> list[str]:
    out = _env_problems(edits.env, f"{where}.env")
    for i, node in enumerate(edits.device_nodes):
        at = f"{where}.deviceNodes[{i}]"
        if not _absolute(node.path):
            out.append(f"{at}.path {node.path!r} is not an absolute path")
        if node.host_path and not _absolute(node.host_path):
            out.append(f"{at}.hostPath {node.host_path!r} is not an absolute path")
        if node.type and node.type not in DEVICE_NODE_TYPES:
            out.append(f"{at}.type {node.type!r} is not one of {sorted(DEVICE_NODE_TYPES)}")
        if node.permissions and set(node.permissions) - set("rwm"):
            out.append(f"{at}.permissions {node.permissions!r} may only use 'r', 'w' and 'm'")
        if not (_in_range(node.major, 0, INT64_MAX) and _in_range(node.minor, 0, INT64_MAX)):
            out.append(f"{at}: major/minor must be non-negative")
        if not _in_range(node.file_mode, 0, 0o7777):
            out.append(f"{at}.fileMode {node.file_mode} is not a permission mode (0..0o7777)")
        if not (_in_range(node.uid, 0, UINT32_MAX) and _in_range(node.gid, 0, UINT32_MAX)):
            out.append(f"{at}: uid/gid must be within 0..{UINT32_MAX}")
    for i, mount in enumerate(edits.mounts):
        if not mount.host_path:
            out.append(f"{where}.mounts[{i}].hostPath is empty")
        if not _absolute(mount.container_path):
            out.append(f"{where}.mounts[{i}].containerPath {mount.container_path!r} is not an absolute path")
    for i, hook in enumerate(edits.hooks):
        at = f"{where}.hooks[{i}]"
        if hook.hook_name not in HOOK_NAMES:
            out.append(f"{at}.hookName {hook.hook_name!r} is not one of {sorted(HOOK_NAMES)}")
        if not _absolute(hook.path):
            out.append(f"{at}.path {hook.path!r} is not an absolute path")
        out += _env_problems(hook.env, f"{at}.env")
        if not _in_range(hook.timeout, 1, UINT32_MAX):
            out.append(f"{at}.timeout {hook.timeout} must be a positive number of seconds")
    out += [
        f"{where}.additionalGids[{i}] {gid} is not within 0..{UINT32_MAX}"
        for i, gid in enumerate(edits.additional_gids)
        if not _in_range(gid, 0, UINT32_MAX)
    ]
    # As the CDI library (v1.1.0): no host or container interface name twice in one containerEdits.
    seen: dict[str, set[str]] = {"hostInterfaceName": set(), "name": set()}
    for i, net in enumerate(edits.net_devices):
        for key, value in (("hostInterfaceName", net.host_interface_name), ("name", net.name)):
            problem = kernel_name_problem(value)
            if problem is not None:
                out.append(f"{where}.netDevices[{i}].{key} {value!r} is not a valid network interface name: {problem}")
            elif value in seen[key]:
                out.append(f"{where}.netDevices[{i}].{key} {value!r} is used twice")
            seen[key].add(value)
    return out


def validate_spec(spec: Spec) -> list[str]:
    """Everything wrong with `spec` that the CDI loader would refuse (the JSON schema checks none of it)."""
    out: list[str] = []
    try:
        parse_kind(spec.kind)
    except CdiNameError as e:
        out.append(str(e))
    if not spec.devices:
        out.append("spec has no devices")
    seen: set[str] = set()
    for i, device in enumerate(spec.devices):
        problem = _device_problem(device.name)
        if problem:
            out.append(f"devices[{i}]: {problem}")
        elif device.name in seen:
            out.append(f"devices[{i}]: device name {device.name!r} is used twice")
        seen.add(device.name)
        out += _edits_problems(device.container_edits, f"devices[{i}].containerEdits")
    out += _edits_problems(spec.container_edits, "containerEdits")
    needed = minimum_version(spec)
    declared, required = parse_version(spec.version()), parse_version(needed)
    if declared is None:
        out.append(f"cdiVersion {spec.version()!r} is not a known CDI version")
    elif required is not None and declared < required:
        out.append(f"cdiVersion {spec.version()!r} is lower than {needed!r}, which this spec's content needs")
    return out
