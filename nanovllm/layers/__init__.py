"""Model building blocks of the data plane: linear layers that shard for tensor
parallelism, embeddings, norms, rotary embedding, attention over the paged KV cache,
and the sampler."""
