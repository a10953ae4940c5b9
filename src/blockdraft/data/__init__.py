"""Completions -> training rows: reading and normalising completions, rendering turns with exact loss masks, the
tokenize stage."""
