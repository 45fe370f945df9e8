"""Speculative decoding with n-gram (prompt-lookup) drafts, imported only when
`speculative_config` is set: the config (config.py), the proposer (ngram.py), the scheduler that
gives a decoding row its drafts and rolls back the rejected ones (scheduler.py), and the
counters (metrics.py). The engine's step loop for it is engine/speculative.py."""
