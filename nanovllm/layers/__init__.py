"""Model building blocks: tensor-parallel linears, embeddings, norms, RoPE, attention."""
