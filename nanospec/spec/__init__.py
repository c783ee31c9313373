"""Speculative decoding: proposers (n-gram, draft model) and their configuration."""
