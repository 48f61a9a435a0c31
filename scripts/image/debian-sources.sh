#!/usr/bin/env bash
# Prints where the image's Debian 12 packages come from: the sources files that build-image.sh hands mmdebstrap as
# its mirrors, one a line. That is the file DEBIAN_SOURCES names (a sources.list or deb822 .sources file), else
# the files of this machine's apt configuration that list Debian 12 (bookworm, and its bookworm-* suites: updates,
# security), as apt itself reads that configuration: the site's own mirror or proxy, whatever it is. Such a file
# must list nothing else, as mmdebstrap takes it whole.
set -euo pipefail

if [[ -n ${DEBIAN_SOURCES:-} ]]; then
    if [[ ! -f $DEBIAN_SOURCES || ! -r $DEBIAN_SOURCES ]]; then
        echo "debian-sources.sh: DEBIAN_SOURCES=$DEBIAN_SOURCES is not a readable file;" \
            "give a sources.list or deb822 .sources file" >&2
        exit 1
    fi
    realpath "$DEBIAN_SOURCES"
    exit 0
fi

# Every binary package source apt has configured: its suite and "<file>:<entry>" (no download needed).
declare -A debian=() other=()
# shellcheck disable=SC2016 # apt's format, not the shell's
while read -r suite entry; do
    file=${entry%:*}
    if [[ $suite == bookworm || $suite == bookworm-* ]]; then
        debian[$file]=1
    else
        other[$file]="$suite"
    fi
done < <(apt-get indextargets --no-release-info --format '$(RELEASE) $(SOURCESENTRY)' 'Target-Of: deb')

if ((${#debian[@]} == 0)); then
    echo "debian-sources.sh: this machine's apt sources list no Debian 12 (bookworm);" \
        "set DEBIAN_SOURCES to a sources file of Debian 12's" >&2
    exit 1
fi
for file in "${!debian[@]}"; do
    if [[ -n ${other[$file]:-} ]]; then
        echo "debian-sources.sh: $file lists more than Debian 12 (suite ${other[$file]});" \
            "set DEBIAN_SOURCES to a sources file of Debian 12's alone" >&2
        exit 1
    fi
done
printf '%s\n' "${!debian[@]}" | sort
