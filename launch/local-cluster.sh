#!/usr/bin/env bash
# Run a zpath cluster on this machine in the foreground; Ctrl-C stops it.
# Usage: launch/local-cluster.sh [--islands N] [--hosts-per-island H] [--devices-per-host D]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${ZPATH_PYTHON:-$here/.venv/bin/python}"
[ -x "$python" ] || python=python3
exec "$python" -m zpath up "$@"
