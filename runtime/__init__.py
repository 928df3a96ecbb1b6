"""What a serving node runs around the model: sampling (penalties, grammar masks, logprobs),
block tables, offline and speculative generation, rank groups, the node process, and the
node-loop base both node servers are built on (`runtime.node_loop`)."""
