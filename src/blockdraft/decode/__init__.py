"""Greedy speculative decoding with a DFlash drafter or an n-gram drafter, and the `eval` stage built on it."""
