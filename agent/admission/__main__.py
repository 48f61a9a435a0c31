"""`python -m agent.admission [DRIVER=NEW_NAME ...]`: print the admission policies for the agent's own drivers (what
deploy/base/40-admission-policy.yaml holds: the parameters' schema, and the namespaces allowed each
reconfiguration); with the renames of the `driver_names` setting when a node uses them."""

from __future__ import annotations

import argparse
import sys

from agent.admission.policy import builtin_drivers, policy_objects, render
from agent.admission.reconfigurations import reconfiguration_objects


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.admission", description=__doc__)
    parser.add_argument("renames", nargs="*", metavar="DRIVER=NEW_NAME",
                        help="a driver published under another name (the driver_names setting)")
    args = parser.parse_args(argv)
    drivers = builtin_drivers()
    for rename in args.renames:
        old, sep, new = rename.partition("=")
        if not sep or old not in drivers or not new:
            parser.error(f"{rename!r}: expected DRIVER=NEW_NAME with DRIVER one of {', '.join(drivers)}")
        drivers[new] = drivers.pop(old)
    drivers = dict(sorted(drivers.items()))
    sys.stdout.write(render([*policy_objects(drivers), *reconfiguration_objects(drivers)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
