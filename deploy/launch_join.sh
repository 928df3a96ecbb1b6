#!/usr/bin/env bash
# Start one node that joins a running cluster without being in its config (`duet node`): a
# pool pod on Kubernetes, or a node added by hand.
#   deploy/launch_join.sh --role prefill|decode --config CONFIG --name NAME --control-port P
#       [--kv-port K] [--host H] [--model DIR]
# $PYTHON picks the interpreter.
set -euo pipefail
exec "${PYTHON:-python}" -m deploy.cli node "$@"
