#!/usr/bin/env bash
# Start rank RANK (1..R-1) of a tensor-parallel prefill node whose ranks run on several hosts
# (its [[prefill]] entry names them in `rank_hosts`), on that rank's host.
#   deploy/launch_prefill_rank.sh CONFIG NODE RANK [--model DIR]
# The rank loads its shard, then serves rank 0 (deploy/launch_prefill.sh CONFIG NODE on the
# node's host) at its group_port, and every restarted rank 0 after it, until a signal stops
# it. $PYTHON picks the interpreter.
set -euo pipefail
if [[ $# -lt 3 || "$1" == -* || "$2" == -* || "$3" == -* ]]; then
    echo "usage: $0 CONFIG NODE RANK [--model DIR]" >&2
    exit 2
fi
config="$1"
node="$2"
rank="$3"
shift 3
exec "${PYTHON:-python}" -m prefill_node.ranks --config "$config" --node "$node" --rank "$rank" "$@"
