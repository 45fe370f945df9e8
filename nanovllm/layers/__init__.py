"""Model building blocks: linear layers that shard for tensor parallelism, embeddings,
norms, rotary embedding, activation and the attention layer."""
