"""What a serving node runs around the model: sampling (penalties, grammars, logprobs), block
tables, offline and speculative generation, rank groups and the node process's lifecycle."""
