#!/usr/bin/env bash
# Start one decode node of a cluster on this host.
#   deploy/launch_decode.sh CONFIG NODE [--model DIR]
# CONFIG is the cluster's TOML file, the same on every host; NODE is a [[decode]] name in it
# (with `replicas`, "NAME-i"). $PYTHON picks the interpreter.
set -euo pipefail
if [[ $# -lt 2 || "$1" == -* || "$2" == -* ]]; then
    echo "usage: $0 CONFIG NODE [--model DIR]" >&2
    exit 2
fi
config="$1"
node="$2"
shift 2
exec "${PYTHON:-python}" -m decode_node --config "$config" --node "$node" "$@"
