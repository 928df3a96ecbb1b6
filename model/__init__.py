"""The DeepSeek model and its weights: config-driven layers on `native` ops, the paged latent
KV pool they attend over, checkpoint readers, the packed weight store, quantization, and the
tensor/sequence/expert parallel transforms."""
