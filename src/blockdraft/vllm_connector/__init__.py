"""Code that runs inside vLLM's own process (the engine's Python, `make engine`), put on its path by blockdraft:
`blockdraft_features` saves the target's hidden states of each request for training."""
