"""How much each slot of a block counts in the loss: the paper's fixed decay, or D-PACE weights that follow the drafter.

`dflash.loss_weighting` picks one; it is pinned in the checkpoint's config and in the run's identity like `dflash.gamma`.

- **exponential** (default, the DFlash paper's): slot k >= 1 of a block weighs `exp(-(k - 1) / gamma)`, fixed for the whole run.
  The batch carries these weights (`batch.slot_decay`); the loss is `sum(w * CE) / sum(w)`.
- **dpace** (D-PACE, "Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting", arXiv 2605.18810; the same
  definition is implemented in vllm-project/speculators `src/speculators/losses/utils.py` (`dpace_loss_decay`) and in
  sgl-project/SpecForge `specforge/algorithms/common/dflash_family_model.py` (`OnlineDFlashModel._dpace_weight`)): per block,
  with the drafter's own probability of the label at each supervised slot, `q_k = exp(-CE_k)` (no gradient), smoothed
  `s_k = (1 - alpha) * q_k + alpha` (`dflash.dpace_alpha`, default 0.5; 1 on unsupervised slots), the weight of slot k is
  `w_k = m_k * sum_{j >= k} m_j * prod_{i <= j} s_i` (m the supervision mask). That is the derivative of the expected
  acceptance length `sum_j prod_{i <= j} s_i` with respect to `log s_k`: a slot counts by how many later tokens its
  acceptance gates, measured on this batch with the current drafter, so the weights move with the drafter as it learns
  (early in training they fall off steeply, later they flatten). Being computed from the batch, they need no running
  statistics, and a resumed run computes exactly what an uninterrupted one would. The loss is normalised by the global count
  of supervised slots (as speculators does), so it is `sum(w * CE) / count`, not a weighted mean: the weights' sum is part of
  the signal (it grows as acceptance grows). gamma is still resolved and pinned, and unused.
"""

from __future__ import annotations

import torch


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE weights [R] (detached, fp32) of R = blocks * block_size rows in block order, from each row's cross-entropy
    against its label `ce` [R] and its supervision mask `supervised` [R] (bool or 0/1); 0 where unsupervised."""
    if ce.numel() % block_size:
        raise ValueError(f"{ce.numel()} rows are not whole blocks of {block_size}")
    with torch.no_grad():
        m = supervised.reshape(-1, block_size).float()
        smoothed = (1.0 - alpha) * torch.exp(-ce.detach().float().reshape(-1, block_size)) + alpha
        prefix = torch.cumprod(torch.where(m > 0, smoothed, torch.ones_like(smoothed)), dim=-1)
        suffix = (prefix * m).flip(-1).cumsum(-1).flip(-1)  # sum over j >= k of m_j * prefix_j
        return (suffix * m).reshape(-1)


__all__ = ["dpace_weights"]
