"""The fixtures committed under tests/fixtures (see its LICENSE-NOTE.md)."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TOKENIZER_DIR = FIXTURES / "qwen3-tokenizer"  # the Qwen3 tokenizer and its own chat template
TEMPLATES = FIXTURES / "chat-templates"  # <name>.jinja: chat templates of the Qwen3 family
# target/, drafter/, golden.json and golden.safetensors of the reference implementation
GOLDEN = FIXTURES / "dflash-golden"
GOLDEN_TARGET = GOLDEN / "target"
GOLDEN2 = FIXTURES / "dflash2-golden"  # the same for a DFlash2 drafter: its draft step (top-K, walk) and six decodes
