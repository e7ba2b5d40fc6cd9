"""A policy loss of your own, in one file: CISPO (MiniMax-M1, arXiv 2506.13585), which clips
the importance weight instead of the update, so that every token keeps its gradient.

    pyflyte run workflows/dapo.py dapo_loop --set algorithm.loss_fn=examples/my_loss.py:cispo

A loss gets log pi_theta and log pi_theta_old of the response tokens (B, R), the
advantages A_i (B, 1), the mask of tokens that count (B, R) and the run's algorithm
section (dapo.config.AlgorithmConfig: clip_low, clip_high, ...), and returns the
per-token losses (B, R) and float metrics (actor/<name> in MLflow);
algorithm.loss_agg_mode reduces the token losses (token-mean: DAPO's).
"""

import torch

from dapo.algorithm.loss import LOG_RATIO_CLAMP, masked_mean


def cispo(log_prob, old_log_prob, advantages, response_mask, config):
    """L_{i,t} = -sg(clip(r_{i,t}, 1 - eps_low, 1 + eps_high)) * A_i * log pi_theta(o_{i,t})."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high).detach()
    token_loss = -weight * advantages * log_prob
    with torch.no_grad():
        metrics = {
            "cispo_weight_mean": masked_mean(weight, response_mask).item(),
            "ratio_mean": masked_mean(ratio, response_mask).item(),
        }
    return token_loss, metrics
