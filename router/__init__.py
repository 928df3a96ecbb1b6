"""The router: an OpenAI-compatible HTTP gateway in front of prefill and decode nodes.

- app.py: FastAPI endpoints, SSE, client disconnects; api.py: request bodies and error bodies
- core.py: admission, pairing, the per-request protocol, node health; state.py: the request
  state machine; nodes.py: node liveness and load; policy.py: the pairing policy;
  prefix_affinity.py: the router's guess of what each prefill node's prefix cache holds
- transport.py: ZeroMQ sockets to the nodes; text.py: incremental detokenization and stop
  strings; metrics.py: Prometheus metrics; __main__.py: `python -m router --config FILE`
"""
