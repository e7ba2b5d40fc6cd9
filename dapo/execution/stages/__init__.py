"""The DAPO step as plain functions, by stage: what each Flyte task calls, and what tests call.

    setup.prepare_data -> setup.bootstrap_policy
      -> [generation.rollout -> scoring.verify_rewards -> scoring.filter_groups]+
      -> training.policy_step (guard: the rollout guard) -> validation.evaluate

Every function takes the config and plain paths or pyarrow tables, and derives its
randomness from (config.seed, step, round) so that a re-run reproduces it."""
