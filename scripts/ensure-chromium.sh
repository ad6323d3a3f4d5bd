#!/usr/bin/env bash
# Make sure /usr/bin/chromium exists for the dashboard's browser test (tests/dashboard/test_browser.py).
# Installs Debian's chromium package when it is missing (as root, apt-get available).
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "ensure-chromium: installing Chromium from Debian packages" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
  echo "ensure-chromium: /usr/bin/chromium is missing and cannot be installed (need root and apt-get)" >&2
  exit 1
fi
if [ ! -x /usr/bin/chromium ]; then
  echo "ensure-chromium: the chromium package did not provide /usr/bin/chromium" >&2
  exit 1
fi
