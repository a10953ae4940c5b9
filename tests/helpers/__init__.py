"""What several test modules share, imported as `helpers.<module>` (pytest puts tests/ on sys.path).

- `paths`: the committed fixtures (Qwen3 tokenizer, chat templates, DFlash golden vectors).
- `s3server`: a real SeaweedFS S3 server on 127.0.0.1 (`SeaweedS3`), its identities and free ports.
- `artifacts`: committed local artifacts and the transfer destinations (`Destination`) the store tests write to.
- `reporters`: reporters that keep what a stage told them (`ProgressLog`).
- `tokenize_data`: conversations and corpora on disk, a tokenize config and run, the rows and files of an output.
- `train_data`: learnable tokenized rows from the golden target, a train config file, the metrics log.
- `decode`: one-call speculative decoding of one prompt with a DFlash or n-gram drafter.
- `hybrid`: tiny random hybrid-attention targets (composite Qwen3.5 with vision tower and M-RoPE, Qwen3-Next) built from
  config and saved with a tokenizer and the Qwen3.6 chat template.

Fixtures live in tests/conftest.py; test modules import helpers from here, never from each other or from conftest.
"""
