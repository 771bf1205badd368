"""blockd's data plane: KV pool shards, kernels, the snapshot follower, the worker service."""
