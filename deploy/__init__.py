"""Tooling above every floor: the `duet` CLI, the one-machine launcher and its supervisor,
cluster planning, the Kubernetes renderer, probes and dashboards."""
