"""A checkpoint decoded for real during training (train.decode_eval_prompts, docs/TRAINING-SIGNAL.md): the checkpoint's
weights draft for the target on a few held-out prompts with the loop eval runs (`blockdraft.decode.speculative`), each
output checked token for token against target-only greedy decoding, and tau and speedup measured as eval measures them.

Prompts are the held-out rows' ids before their first supervised token, in their order (train.data's held-out split, as
eval takes them; with train.eval_data, that artifact's train split and then its held-out split); each is decoded up to
eval.max_new_tokens, stopping at the target's end-of-sequence ids.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from blockdraft.config import EvalConfig
from blockdraft.decode.speculative import DFlashProposer, greedy_decode, run_speculative
from blockdraft.model import DFlashDrafter, TargetHead


def held_out_prompts(dataset: Dataset | None, count: int) -> list[list[int]]:
    """Up to `count` prompts of the held-out rows: each row's ids before its first supervised token (a row supervised
    from token 0 has none and is skipped)."""
    prompts: list[list[int]] = []
    for r in dataset if dataset is not None and count else ():
        assert isinstance(r, dict)  # a Dataset's row
        supervised = np.flatnonzero(np.asarray(r["loss_mask"]))
        if supervised.size and supervised[0]:
            prompts.append(list(r["input_ids"][: supervised[0]]))
        if len(prompts) >= count:
            break
    return prompts


@functools.lru_cache(maxsize=4)
def _eos_of_tokenizer(folder: str | None) -> int | None:
    """The eos id of the tokenizer in `folder`, or None when none loads from it."""
    try:
        return AutoTokenizer.from_pretrained(folder).eos_token_id if folder else None
    except (OSError, ValueError):
        return None


def target_stop_ids(hf_model: Any, tokenizer_folder: str | None) -> list[int]:
    """The target's end-of-sequence ids: its generation config's and its tokenizer's, the ids eval stops on."""
    ids: set[int] = set()
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if (tokenizer_eos := _eos_of_tokenizer(tokenizer_folder)) is not None:
        ids.add(tokenizer_eos)
    return sorted(ids)


def _lossless(spec_tokens: list[int], greedy_tokens: list[int], prompt_len: int, margins: list[float], tolerance: float) -> bool:
    """Whether the speculative output is the greedy one, or first departs from it at a rounding near-tie (a top-2
    margin within `tolerance` there), as eval's check counts it."""
    if spec_tokens == greedy_tokens:
        return True
    common = min(len(spec_tokens), len(greedy_tokens))
    position = next((i for i in range(common) if spec_tokens[i] != greedy_tokens[i]), common)
    new_index = position - prompt_len
    return 0 <= new_index < len(margins) and margins[new_index] <= tolerance


def decode_checkpoint(
    drafter: DFlashDrafter, hf_model: Any, prompts: list[list[int]], settings: EvalConfig, stops: list[int],
) -> dict[str, Any]:
    """{"tau", "speedup", "lossless", "prompts", "new_tokens", "seconds"} of `drafter`'s current weights, copied in the
    target's dtype (as eval loads a checkpoint), over `prompts`. speedup: greedy wall time / speculative wall time."""
    param = next(hf_model.parameters())
    copy = DFlashDrafter(drafter.spec)
    copy.load_state_dict(drafter.state_dict())
    device = next(drafter.parameters()).device
    copy = copy.to(device=device, dtype=param.dtype).eval()
    head = TargetHead.from_target(hf_model, device=device).to(param.dtype)
    tolerance = settings.divergence_margin_fp32 if param.dtype == torch.float32 else settings.divergence_margin_bf16
    greedy_decode(hf_model, prompts[0], 2)  # one-time costs out of the timings, as eval's warm-up
    run_speculative(hf_model, DFlashProposer(copy, head), prompts[0], 2)
    lengths: list[int] = []
    greedy_s = spec_s = 0.0
    lossless, new_tokens = True, 0
    for prompt in prompts:
        reference = greedy_decode(hf_model, prompt, settings.max_new_tokens, stops)
        result = run_speculative(hf_model, DFlashProposer(copy, head), prompt, settings.max_new_tokens, stops)
        lengths += result.acceptance_lengths
        greedy_s, spec_s = greedy_s + reference.wall_s, spec_s + result.wall_s
        new_tokens += len(result.new_tokens)
        lossless &= _lossless(result.tokens, reference.tokens, reference.prompt_len, reference.margins, tolerance)
    return {
        "tau": sum(lengths) / len(lengths) if lengths else 0.0,
        "speedup": greedy_s / spec_s if spec_s else 0.0,
        "lossless": lossless,
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "seconds": greedy_s + spec_s,
    }


__all__ = ["decode_checkpoint", "held_out_prompts", "target_stop_ids"]
