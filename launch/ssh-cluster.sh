#!/usr/bin/env bash
# Run a zpath cluster over ssh in the foreground: the controller here, one worker per
# hostfile line on its host. Ctrl-C (or `zpath down`) stops every process it started.
# Usage: launch/ssh-cluster.sh HOSTFILE [--bind-host ADDR] [--remote-python PATH] [zpath up options]
set -euo pipefail
if [ $# -lt 1 ] || [ ! -r "$1" ]; then
    echo "usage: $0 HOSTFILE [zpath up options]" >&2
    exit 2
fi
hostfile="$1"; shift
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${ZPATH_PYTHON:-$here/.venv/bin/python}"
[ -x "$python" ] || python=python3
exec "$python" -m zpath up --hostfile "$hostfile" "$@"
