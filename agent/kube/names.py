"""Name and value formats of the Kubernetes API: DNS labels and subdomains, label keys and values, driver names,
qualified attribute names, semantic versions, UIDs, a condition's reason; and what a reference to a claim must be
(a UID, a namespace and a name). The one home of these formats in the agent: the slice, claim-status and Event
rules, the request paths and the test API server all check names here.

Predicates accept any object, so raw JSON values can be passed. Each format has a message in the agent's words,
saying what is allowed (`*_MSG`, for a plugin author or an operator), and, where a rule answers as the API server
does, the server's own words (`SERVER_*_MSG`: apimachinery's messages without the regular expression and the
examples the server appends to some).
"""

from __future__ import annotations

import functools
import json
import re

from backends.contract import is_semver as _backend_semver

__all__ = [
    "DNS_LABEL_MSG",
    "DRIVER_MSG",
    "LABEL_KEY_MSG",
    "LABEL_VALUE_MSG",
    "MAX_DRIVER_NAME_LENGTH",
    "MAX_ID_LENGTH",
    "NODE_NAME_MSG",
    "QUALIFIED_MSG",
    "SEMVER_MSG",
    "SERVER_CONDITION_REASON_MSG",
    "SERVER_DNS_LABEL_MSG",
    "SERVER_NAME_PART_MSG",
    "SERVER_SUBDOMAIN_MSG",
    "SUBDOMAIN_MSG",
    "claim_reference_problem",
    "is_c_identifier",
    "is_condition_reason",
    "is_dns_label",
    "is_dns_subdomain",
    "is_driver_name",
    "is_label_key",
    "is_label_value",
    "is_node_name",
    "is_qualified_name",
    "is_semver",
    "is_uid",
]

MAX_ID_LENGTH = 32
MAX_DRIVER_NAME_LENGTH = 63

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_RE = re.compile(_LABEL)
_DNS_SUBDOMAIN_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_C_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME_RE = re.compile(r"(?:[A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_UID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_CONDITION_REASON_RE = re.compile(r"[A-Za-z](?:[A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_SHOWN = 80  # characters of a refused reference's value a message shows

DNS_LABEL_MSG = "must be a DNS label: 1-63 lower-case letters, digits or '-', alphanumeric at both ends"
SUBDOMAIN_MSG = "must be a DNS subdomain: at most 253 lower-case letters, digits, '-' or '.'"
DRIVER_MSG = "must be at most 63 characters that, lower-cased, form a DNS subdomain (e.g. gpu.example.com)"
NODE_NAME_MSG = "must be a node name (a DNS subdomain of at most 253 characters)"
QUALIFIED_MSG = (
    "must be a C identifier of at most 32 characters, optionally prefixed by a DNS subdomain and '/'"
)
LABEL_KEY_MSG = "must be a label key: [DNS subdomain '/'] name of 1-63 letters, digits, '-', '_', '.'"
LABEL_VALUE_MSG = "must be empty or 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
SEMVER_MSG = "must be semver 2.0.0: three numeric parts, no 'v', e.g. 1.2.3 or 1.2.3-rc.1+build.5"

SERVER_DNS_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
                        "must start and end with an alphanumeric character")
SERVER_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                        "'.', and must start and end with an alphanumeric character")
SERVER_NAME_PART_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                        "with an alphanumeric character")
SERVER_CONDITION_REASON_MSG = ("a condition reason must start with alphabetic character, optionally followed by a "
                               "string of alphanumeric characters or '_,:', and must end with an alphanumeric "
                               "character or '_'")


def is_dns_label(s: object) -> bool:
    """RFC 1123 label: at most 63 lower-case alphanumerics or '-', alphanumeric at both ends."""
    return isinstance(s, str) and len(s) <= 63 and _DNS_LABEL_RE.fullmatch(s) is not None


def is_dns_subdomain(s: object) -> bool:
    """RFC 1123 subdomain: at most 253 characters of dot-separated DNS labels."""
    return isinstance(s, str) and len(s) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(s) is not None


def is_c_identifier(s: object) -> bool:
    """C identifier: a letter or '_', then letters, digits or '_' (no length limit)."""
    return isinstance(s, str) and _C_IDENTIFIER_RE.fullmatch(s) is not None


def is_label_key(s: object) -> bool:
    """Label key: optional DNS-subdomain prefix and '/', then a name of 1-63 characters."""
    if not isinstance(s, str) or s.count("/") > 1:
        return False
    prefix, slash, name = s.rpartition("/")
    if slash and not is_dns_subdomain(prefix):
        return False
    return len(name) <= 63 and _LABEL_NAME_RE.fullmatch(name) is not None


def is_label_value(s: object) -> bool:
    """Label value: empty, or at most 63 characters in the label-name format."""
    return isinstance(s, str) and (s == "" or (len(s) <= 63 and _LABEL_NAME_RE.fullmatch(s) is not None))


def is_driver_name(s: object) -> bool:
    """Driver name (ValidateCSIDriverName): 1-63 bytes whose lower-cased form is a DNS subdomain."""
    if not isinstance(s, str) or not 0 < len(s.encode()) <= MAX_DRIVER_NAME_LENGTH:
        return False
    # Go lower-cases with the simple case mapping, which turns U+0130 into a plain 'i';
    # Python's full mapping would add a combining dot.
    return is_dns_subdomain(s.replace("\u0130", "i").lower())


def is_qualified_name(s: object) -> bool:
    """Attribute or capacity key: ``ID`` or ``DOMAIN/ID`` (Q1-Q5)."""
    return isinstance(s, str) and _is_qualified_name(s)


@functools.lru_cache(maxsize=4096)  # the same few keys on every device of a pool
def _is_qualified_name(s: str) -> bool:
    if s.count("/") > 1:
        return False
    domain, slash, ident = s.rpartition("/")
    if slash and not is_driver_name(domain):
        return False
    return len(ident) <= MAX_ID_LENGTH and is_c_identifier(ident)


def is_semver(s: object) -> bool:
    """Strict semantic version 2.0.0, as checked for version attributes (V4)."""
    return isinstance(s, str) and _backend_semver(s)


def is_node_name(s: object) -> bool:
    """Node name: a DNS subdomain."""
    return is_dns_subdomain(s)


def is_uid(s: object) -> bool:
    """An object's UID as the API server makes it: a UUID in lower-case hex."""
    return isinstance(s, str) and _UID_RE.fullmatch(s) is not None


def is_condition_reason(s: object) -> bool:
    """A condition's `reason` (metav1.Condition): a letter, then letters, digits, '_', ',' or ':', ending in a
    letter, a digit or '_'."""
    return isinstance(s, str) and _CONDITION_REASON_RE.fullmatch(s) is not None


def claim_reference_problem(uid: str, namespace: str, name: str) -> str:
    """What is wrong with a reference to a ResourceClaim (empty when nothing is): no API server makes a claim with
    this UID, namespace or name, so the reference must never reach a file name, a URL or an Event."""
    if not is_uid(uid):
        return f"claim UID {json.dumps(uid[:_SHOWN])} is not a Kubernetes UID"
    if not is_dns_label(namespace):
        return f"claim namespace {json.dumps(namespace[:_SHOWN])} is not a valid namespace name"
    if not is_dns_subdomain(name):
        return f"claim name {json.dumps(name[:_SHOWN])} is not a valid object name"
    return ""
