#!/usr/bin/env bash
# Make sure a `prometheus` binary is on PATH for the real-Prometheus agreement tests.
# Installs Debian's prometheus package when there is none (as root, apt-get available). The tests
# start their own throwaway server on a free loopback port, so the packaged service must not be
# left running on :9090 after the install.
set -euo pipefail

if command -v prometheus >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "ensure-prometheus: no prometheus binary on PATH and cannot install it (need root and apt-get);" \
       "install Prometheus (2.42 or newer) and put it on PATH" >&2
  exit 1
fi
echo "ensure-prometheus: installing Prometheus from Debian packages" >&2
# policy-rc.d exit 101 tells invoke-rc.d not to start services the package installs.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod +x "$policy"
  created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null

# Belt and braces: stop a packaged service that started anyway (systemd or sysvinit machines).
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
  systemctl stop prometheus || true
  systemctl disable prometheus >/dev/null 2>&1 || true
fi
if [ -x /etc/init.d/prometheus ]; then
  /etc/init.d/prometheus stop >/dev/null 2>&1 || true
fi

if ! command -v prometheus >/dev/null; then
  echo "ensure-prometheus: the prometheus package installed but no prometheus binary is on PATH" >&2
  exit 1
fi
prometheus --version 2>&1 | head -n 1 >&2
