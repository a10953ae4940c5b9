"""Regenerating completions with the target (`blockdraft generate`): engines, a local test endpoint, the stage."""
