#!/usr/bin/env bash
# Set up .venv (with the test dependencies) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test

# Real components some tests start on their own (redis-server for the Redis store, headless
# Chromium for the dashboard): install the OS packages where missing (Debian/Ubuntu, as root or
# with password-less sudo); if that fails, those tests skip and say why.
# Usage: install_missing "COMMAND..." "PACKAGE..." "WHO NEEDS IT"
install_missing() {
    local command missing=0
    for command in $1; do command -v "$command" >/dev/null 2>&1 || missing=1; done
    [ "$missing" = 1 ] || return 0
    local sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    # shellcheck disable=SC2086  # $2 is a list of package names
    if ! { command -v apt-get >/dev/null 2>&1 &&
           timeout 600 "${sudo[@]}" apt-get update -qq &&
           timeout 900 "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
               apt-get install -y -qq --no-install-recommends $2 >/dev/null; }; then
        echo "warning: could not install $2; $3 will skip" >&2
    fi
}
install_missing "redis-server" "redis-server" "the Redis store tests"
install_missing "chromium chromedriver" "chromium chromium-driver" "the dashboard's browser test"
# One pytest-xdist worker per usable CPU, at most 4 (each holds its own copy of the models);
# tests/conftest.py pins each worker to its share of the CPUs. A test file runs whole on one
# worker (--dist loadfile), so module fixtures (servers, engines) start once.
# TEST_WORKERS=0 runs everything in this one process.
workers="${TEST_WORKERS:-$(nproc)}"
[ "$workers" -le 4 ] || workers=4
[ "$workers" -gt 1 ] || workers=0
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
