"""The decode-occupancy reading of /metrics that bench-sweep records per point."""

from bench.occupancy import decode_running

PAGE = """# HELP duet_node_running_requests Requests running on the node (heartbeat)
# TYPE duet_node_running_requests gauge
duet_node_running_requests{node="prefill-0",role="prefill"} 3.0
duet_node_running_requests{node="decode-0",role="decode"} 5.0
duet_node_running_requests{node="decode-1",role="decode"} 2.0
duet_node_queued_requests{node="decode-0",role="decode"} 9.0
"""


def test_sums_the_decode_nodes_running_requests_only():
    assert decode_running(PAGE) == 7.0
    assert decode_running("") == 0.0
