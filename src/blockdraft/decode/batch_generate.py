"""Chat prompts completed in one batch with a Hugging Face model's `generate`: how the `hf` engine regenerates
completions and how the tiny target's fixture writes its sample answers (`blockdraft.data.chat` has the types)."""

from __future__ import annotations

from typing import Any

from blockdraft.data.chat import Completion, Prompt, render_prompt, split_reasoning


def generate_completions(
    model: Any, tokenizer: Any, prompts: list[Prompt], max_new_tokens: int, temperature: float = 0.0,
    top_p: float | None = None, seed: int = 0,
) -> list[Completion]:
    """Complete `prompts` in one left-padded batch with `model.generate`; greedy unless `temperature` > 0, then sampled
    at that temperature (and nucleus `top_p` where given; no top-k cut), torch's generator seeded with `seed` for the
    call and restored after it.

    The end-of-turn token is the generation config's eos (the tokenizer's as a fallback).
    """
    import torch

    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    encoded = [tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, width - len(e) :] = torch.tensor(e)
        attn[i, width - len(e) :] = 1
    # every sampling knob given, so the model's own generation_config (its top_k, top_p) does not slip in
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p or 1.0, "top_k": 0} if temperature > 0
        else {"do_sample": False}
    )
    device = torch.device(model.device)
    # sampling draws from torch's generator on the model's device: seeded for this call, restored after it
    forked = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [],
                                   enabled=temperature > 0)
    with torch.no_grad(), forked:
        if temperature > 0:
            torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=attn.to(model.device), max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos_ids), pad_token_id=pad, **sampling,
        )
    results = []
    for i, (prompt, e) in enumerate(zip(prompts, encoded)):
        new = out[i, width:].tolist()
        stop = next((k for k, t in enumerate(new) if t in eos_ids), None)
        new = new[: stop + 1] if stop is not None else new
        text = tokenizer.decode(new[:stop] if stop is not None else new, skip_special_tokens=True)
        reasoning, content = split_reasoning(text)
        results.append(Completion(prompt.id, content, reasoning, "stop" if stop is not None else "length", e, new))
    return results
