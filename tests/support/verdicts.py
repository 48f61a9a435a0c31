"""What an API server answered to one write, reduced to what the differential tests compare: accepted, or refused
how (422 with the field path and kind of each error, 400 for a body it cannot read, 500 for one it cannot
convert), read from the test API server's ApiError or from kubectl's report of the real server's answer.

kubectl prints a 422 as `The <Kind> "<name>" is invalid: <path>: <kind>: ...`, or with several errors one per line
after `* `; a message may quote a value holding `: `, so an error's path and kind are read from its start only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from simulator.apiserver.resources import ApiError

__all__ = ["ACCEPTED", "Verdict", "field_errors", "from_kubectl", "of_store", "refused"]

# The wording of Go's field.ErrorType, and the reason a Status cause gives for it.
KINDS = {
    "Invalid value": "FieldValueInvalid", "Required value": "FieldValueRequired",
    "Duplicate value": "FieldValueDuplicate", "Unsupported value": "FieldValueNotSupported",
    "Forbidden": "FieldValueForbidden", "Too long": "FieldValueTooLong", "Too many": "FieldValueTooMany",
    "Internal error": "InternalError", "Not found": "FieldValueNotFound",
}  # fmt: skip
_KIND_OF_REASON = {reason: kind for kind, reason in KINDS.items()}
_ERROR = re.compile(r"(?P<path>[^\s:]+): (?P<kind>" + "|".join(map(re.escape, KINDS)) + r")(?::|$)")


@dataclass(frozen=True)
class Verdict:
    """`outcome`: accepted, invalid (422), bad-request (400) or internal (500); `fields`: `"<path>: <kind>"` of
    each error of an invalid one."""

    outcome: str
    fields: frozenset[str] = field(default_factory=frozenset)

    def __str__(self) -> str:
        return self.outcome + (f" {sorted(self.fields)}" if self.fields else "")


ACCEPTED = Verdict("accepted")


def refused(*fields: str) -> Verdict:
    """A 422 naming these `"<path>: <kind>"`."""
    return Verdict("invalid", frozenset(fields))


def field_errors(errors: Iterable[str]) -> frozenset[str]:
    """`"<path>: <kind>"` of errors worded as Go's field.Error (`"<path>: <kind>: <detail>"`)."""
    found = set()
    for error in errors:
        match = _ERROR.match(error)
        assert match, f"not worded as a field error: {error!r}"
        found.add(f"{match['path']}: {match['kind']}")
    return frozenset(found)


def of_store(write: Callable[[], Any]) -> Verdict:
    """The test API server's verdict on a write made straight on its store."""
    try:
        write()
    except ApiError as error:
        if error.code == 422:
            causes = error.details.get("causes") or []
            return refused(*(f"{c['field']}: {_KIND_OF_REASON[c['reason']]}" for c in causes))
        return Verdict({400: "bad-request", 500: "internal"}.get(error.code, f"code {error.code}"))
    return ACCEPTED


def from_kubectl(stderr: str | None) -> Verdict:
    """The real server's verdict as kubectl reports it (None: kubectl succeeded)."""
    if stderr is None:
        return ACCEPTED
    if "Error from server (BadRequest)" in stderr:
        return Verdict("bad-request")
    if " is invalid: " in stderr:
        report = stderr.split(" is invalid: ", 1)[1]
        lines = [line[2:] for line in report.splitlines() if line.startswith("* ")] or [report.strip()]
        return Verdict("invalid", field_errors(lines))
    if "Error from server: " in stderr or "Error from server (InternalError)" in stderr:
        return Verdict("internal")
    raise AssertionError(f"kubectl said something else: {stderr}")
