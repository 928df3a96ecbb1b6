"""The router: an OpenAI-compatible HTTP gateway in front of prefill and decode nodes. It
imports only `control` (no torch, no model, no kernels).

- app.py: FastAPI endpoints, SSE, client disconnects; api.py: request bodies and error bodies;
  serving.py: a body into router requests and their outputs; response_shapes.py: the OpenAI
  response bodies; responses_api.py: `/v1/responses` over the chat path
- chat_output.py: a chat choice's output split by reasoning.py (`<think>` into
  reasoning_content) and tool_parsers.py (tool calls in the text); tools.py: the tools and
  tool_choice fields, and the grammar of a forced call; structured_output.py: the structured
  output fields
- core.py: the coordinator (admission gates, the request API, how a request ends, message
  routing), built of parts: dispatch.py: reserving decode KV and sending the prefill;
  ordering.py: first tokens and each decode step's tokens into the streams, in output order;
  health.py: NodeReady / NodeFailed / heartbeats; watchdog.py: lost nodes, overdue requests,
  lease pings; recovery.py: moving requests of lost nodes, preemption; admission.py: SLA
  admission
- state.py: the request state machine; nodes.py: node liveness and load; policy.py: the
  pairing policy; kv_index.py: the exact index of what each node's prefix cache holds (from
  the nodes' KV events); membership.py: nodes that join at run time and leave;
  autoscale_policy.py and autoscaler.py: `duet up --autoscale`
- transport.py: ZeroMQ sockets to the nodes; text.py: incremental detokenization and stop
  strings; metrics.py: Prometheus metrics; __main__.py: `python -m router --config FILE`
"""
