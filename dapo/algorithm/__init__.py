"""DAPO's formulas as pure functions (Yu et al. 2025, arXiv 2503.14476): the token-level
clipped loss and its registry (loss), group advantages (advantages), the dynamic-sampling
filter (sampling), rollout correction (rollout_correction), and the token batches and
micro-batches they run on (batch, micro_batches). Nothing here knows of engines or Flyte."""
