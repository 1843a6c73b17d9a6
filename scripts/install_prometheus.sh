#!/bin/sh
# Prometheus and promtool for tests/integration/test_prometheus.py (Debian package
# `prometheus`). Idempotent: does nothing when both binaries are already on PATH.
# apt is retried (mirrors and locks held by other jobs fail transiently); the package's
# service is never started (the test runs its own Prometheus).
set -eu

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

attempt=1
while :; do
    if $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=120 \
            install -y -q --no-install-recommends prometheus; then
        break
    fi
    if [ "$attempt" -ge 4 ]; then
        echo "install_prometheus: apt-get install prometheus failed $attempt times" >&2
        exit 1
    fi
    # The package lists may be stale or missing (fresh container): refresh, then retry.
    $SUDO apt-get -o DPkg::Lock::Timeout=120 update -q || true
    sleep $((attempt * 5))
    attempt=$((attempt + 1))
done

command -v prometheus >/dev/null && command -v promtool >/dev/null
