#!/usr/bin/env bash
# A Slurm batch script: start a zpath cluster inside this job (the controller here, on
# the job's first node; one worker per task, each an srun step), run a program against
# it, and stop the cluster when the program ends (the job's end stops it too).
#
# Usage: sbatch [sbatch options] launch/slurm-job.sh [zpath up options] -- PROGRAM [ARGS...]
#   e.g. sbatch --nodes=2 --ntasks-per-node=4 launch/slurm-job.sh --islands 2 -- python train.py
# The program finds the cluster through ZPATH_CONTROLLER and ZPATH_KEY_FILE (zp.init()
# connects to it); the key stays in a 0600 file, never on a command line.
#SBATCH --job-name=zpath
set -euo pipefail
up_options=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do up_options+=("$1"); shift; done
if [ $# -lt 2 ]; then
    echo "usage: sbatch $0 [zpath up options] -- PROGRAM [ARGS...]" >&2
    exit 2
fi
shift
python="${ZPATH_PYTHON:-python3}"
state="$(mktemp -d)/cluster.json"
"$python" -m zpath up --slurm --state "$state" "${up_options[@]}" &
up=$!
trap '"$python" -m zpath down --state "$state" >/dev/null || true; wait $up || true' EXIT
# the state file appears once every worker has registered
until [ -s "$state" ]; do
    if ! kill -0 "$up" 2>/dev/null; then wait "$up"; exit $?; fi
    sleep 0.5
done
read -r address key_file < <("$python" -c 'import json, sys
s = json.load(open(sys.argv[1])); print(s["address"], s["key_file"])' "$state")
ZPATH_CONTROLLER="$address" ZPATH_KEY_FILE="$key_file" "$@"
