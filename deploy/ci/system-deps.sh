#!/usr/bin/env bash
# System packages the test suite needs beyond the Python venv, from Debian's archive:
#   prometheus + promtool  (package `prometheus`)     rule tests, dashboard-query test
#   redis-server + redis-cli (package `redis-server`)  limiter contract suite, Redis Cluster test
#
# Idempotent: installs only what is missing from PATH. Installing needs root; run as another user
# with something missing, it prints the exact command and exits 1.
# Usage: bash deploy/ci/system-deps.sh
set -euo pipefail

declare -A package_of=(
    [prometheus]=prometheus
    [promtool]=prometheus
    [redis-server]=redis-server
    [redis-cli]=redis-server
)

packages=()
for tool in "${!package_of[@]}"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        pkg=${package_of[$tool]}
        [[ " ${packages[*]} " == *" $pkg "* ]] || packages+=("$pkg")
    fi
done

if [ "${#packages[@]}" -eq 0 ]; then
    echo "system-deps: present: ${!package_of[*]}"
    exit 0
fi

install_cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${packages[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "system-deps: missing packages ${packages[*]}; install them as root with:" >&2
    echo "  sudo sh -c '$install_cmd'" >&2
    exit 1
fi

echo "system-deps: installing ${packages[*]}"
apt-get update -qq
# In a container nothing is started by the packages (no init); the tests start their own servers
# on free ports and never touch a system-wide instance.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}"
for tool in "${!package_of[@]}"; do
    command -v "$tool" >/dev/null || { echo "system-deps: $tool still missing" >&2; exit 1; }
done
echo "system-deps: installed ${packages[*]}"
