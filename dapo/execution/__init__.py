"""The two execution modes of a DAPO step: per-stage steps, each a Flyte task (stages/), and
colocated chunks, one process running many steps with rollout and training on the same GPUs
(colocated, and overlap for one-step-off rollout); schedule splits a run into chunks."""
