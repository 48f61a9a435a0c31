#!/bin/sh
# Builds the agent's wheel from the paths listed in scripts/image/sources, with every dependency as a wheel, into
# a folder that scripts/image/install-agent.sh installs from. Needs pip and a package index (PyPI, or what pip is
# configured with).
#
#   build-wheels.sh SOURCE WHEELS    (SOURCE: a folder holding only the listed paths, as deploy/Dockerfile
#                                     copies them; PYTHON: the interpreter whose pip builds, python3 by default)
set -eu
source=${1:?usage: build-wheels.sh SOURCE WHEELS}
wheels=${2:?usage: build-wheels.sh SOURCE WHEELS}
"${PYTHON:-python3}" -m pip wheel --quiet --no-cache-dir --wheel-dir "$wheels" "$source"
