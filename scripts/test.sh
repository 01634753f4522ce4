#!/usr/bin/env bash
# Set up .venv (with the test dependencies) and run the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
# The Redis store's tests start their own redis-server. Install it where missing (Debian/Ubuntu,
# as root or with password-less sudo); if that fails, those tests skip and say why.
if ! command -v redis-server >/dev/null 2>&1; then
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    if ! { command -v apt-get >/dev/null 2>&1 &&
           timeout 600 "${sudo[@]}" apt-get update -qq &&
           timeout 600 "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
               apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }; then
        echo "warning: could not install redis-server; the Redis store tests will skip" >&2
    fi
fi
# The dashboard's browser test drives headless Chromium; same pattern: skips (saying why) if absent.
if ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo -n)
    if ! { command -v apt-get >/dev/null 2>&1 &&
           timeout 600 "${sudo[@]}" apt-get update -qq &&
           timeout 900 "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
               apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; }; then
        echo "warning: could not install chromium; the dashboard browser test will skip" >&2
    fi
fi
exec .venv/bin/python -m pytest -q "$@"
