#!/bin/sh
# The C extensions (gatehouse/**/_*.c) built with AddressSanitizer and
# UndefinedBehaviorSanitizer in a copy of the tree, and tests run over them, stopping at
# the first report.  `make sanitize` runs the unit suite (its C paths are held to the
# Python ones on generated, cut and mutated input); arguments replace that selection:
#   sh scripts/sanitize.sh tests/test_rules_encryption.py -k batches
# The copy keeps the tree's own builds as they are; it is removed at the end.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d /tmp/gatehouse-sanitize-XXXXXX)
trap 'rm -rf "$work"' EXIT INT TERM
tar -C "$here" --exclude=./.venv --exclude=./build --exclude='*.so' \
    --exclude=__pycache__ --exclude=./.mypy_cache --exclude=./.pytest_cache -cf - . \
    | tar -C "$work" -xf -
cd "$work"
CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1" \
    "$python" setup.py -q build_ext --inplace
# Every extension must be the sanitized one: without it the tests would run the Python
# fallbacks (or the tree's own builds) and prove nothing.
for source in $(find gatehouse -name '_*.c'); do
    built=$(ls "${source%.c}".*.so)
    nm -D "$built" | grep -q __asan_report || { echo "not sanitized: $built" >&2; exit 1; }
done
if [ $# -eq 0 ]; then
    # All but the tests that time how long C code holds the GIL: ASan's realloc copies
    # (glibc's moves pages), and a 64 MB answer's copy is a stall the build does not have.
    set -- --ignore=tests/integration --ignore=tests/reliability -k 'not without_the_gil' tests
fi
# Python itself is not instrumented: its allocator's leaks are not ours to report.
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$python" -m pytest -q -p no:cacheprovider "$@"
