#!/bin/sh
# Installs the agent into /opt/dra-agent, a venv of Debian's python3, from a folder of wheels (the agent's and its
# dependencies', built by scripts/image/build-wheels.sh), without the network; then drops pip from the venv and
# what the image does not need. Runs inside the image's root file system: in a chroot from scripts/build-image.sh,
# in a RUN step of deploy/Dockerfile.
#
#   install-agent.sh WHEELS
set -eu
wheels=${1:?usage: install-agent.sh WHEELS}
python3 -m venv /opt/dra-agent
# Byte-compiled at install (pip's default): the root file system is read-only in the DaemonSet.
/opt/dra-agent/bin/python -m pip install --quiet --no-cache-dir --no-index --find-links "$wheels" dra-agent
/opt/dra-agent/bin/python -m pip uninstall --quiet --yes pip setuptools
# Every library a compiled module of a wheel links must be in the image: a missing one fails only when the module
# is imported, on a node (scripts/image/packages lists them).
missing=$(find /opt/dra-agent -type f -name '*.so*' -exec sh -c 'for f; do ldd "$f" | sed -n "s|^\t*\(.*\) => not found|$f: \1|p"; done' sh {} +)
if [ -n "$missing" ]; then
    echo "install-agent.sh: libraries missing from the image (add their packages to scripts/image/packages):" >&2
    echo "$missing" >&2
    exit 1
fi
# The documentation no one reads in a container, and any apt lists.
rm -rf /usr/share/doc/* /usr/share/man/* /usr/share/info/* /usr/share/locale/* /var/cache/debconf/*-old \
    /var/lib/apt/lists/* /var/cache/apt/*
/opt/dra-agent/bin/dra-agent --version
