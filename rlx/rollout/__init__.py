"""Rollout engines behind one protocol: the built-in JAX engine and SGLang servers."""
