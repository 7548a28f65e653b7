"""The model: causal LMs of every family in Flax NNX, their configuration and tensor schema,
positions, sharding, remat, the KV cache, generation and the Tunix bridge."""
