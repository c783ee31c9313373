"""Speculative decoding: the Speculator (one step's propose / verify / commit), the proposers (n-gram,
lookahead, draft model), the goodput policy, and ``speculative_config``."""
