#!/usr/bin/env bash
# Start the router (HTTP gateway) of a cluster on this host.
#   deploy/launch_router.sh CONFIG [--model DIR] [--port P] [--replica I] [--log-level LEVEL]
# CONFIG is the cluster's TOML file, the same on every host. $PYTHON picks the interpreter.
# With [router] replicas, start each router with its own --replica (0, 1, ...).
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 CONFIG [--model DIR] [--port P]" >&2
    exit 2
fi
config="$1"
shift
exec "${PYTHON:-python}" -m router --config "$config" "$@"
