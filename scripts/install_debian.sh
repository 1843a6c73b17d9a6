#!/bin/sh
# Debian packages the tests run for real: install_debian.sh "COMMANDS" PACKAGE...
# Does nothing when every command in COMMANDS is already there (on PATH or in
# /usr/sbin, where the Kerberos KDC's tools live). apt is retried (mirrors and locks
# held by other jobs fail transiently; the package lists may be stale or missing on a
# fresh machine, so they are refreshed between tries); no package's service is used
# (the tests start their own).
set -eu

commands=$1
shift

present() {
    for command in $commands; do
        command -v "$command" >/dev/null 2>&1 || [ -x "/usr/sbin/$command" ] || return 1
    done
}

if present; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

attempt=1
while :; do
    if $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 \
            install -y -q --no-install-recommends "$@"; then
        break
    fi
    if [ "$attempt" -ge 4 ]; then
        echo "install_debian: apt-get install $* failed $attempt times" >&2
        exit 1
    fi
    $SUDO apt-get -o DPkg::Lock::Timeout=120 update -q || true
    sleep $((attempt * 5))
    attempt=$((attempt + 1))
done

present || { echo "install_debian: $* installed, but not all of: $commands" >&2; exit 1; }
