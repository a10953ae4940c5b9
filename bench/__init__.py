"""Benchmarks: each prints ratios against a reference measured in the same run. Run them as modules from the repo
root (`python -m bench.train`), so this folder never shadows a standard-library module such as `tokenize`."""
