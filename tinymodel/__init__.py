"""The built-in models: the tiny model the local cluster and tests serve (its tokenizer,
corpus and trainer), and random full-size checkpoints for benchmarks."""
