"""DAPO: the algorithm and its execution, free of Flyte (tasks/ and workflows/ hold the Flyte code).

Packages, each importing only those listed below it:
    cluster     what a run costs and whether its timeouts cover it (cluster_cost, run_budget)
    execution   the two execution modes: per-stage steps (stages/) and colocated chunks
                (colocated, overlap), and the schedule of chunks
    engines     rollout engines (vLLM, Hugging Face), trainers (DeepSpeed, torch) and the
                policy update that drives a trainer
    model, rewards, data
                the policy's sources (a hub name, a GGUF file, the embedded tiny policy), the
                verifiers and scorers, the prompt data and reasoning-gym's tasks
    config      the run's typed configuration: schema, presets, the override parser
    algorithm   DAPO's formulas: loss, advantages, the dynamic-sampling filter, rollout
                correction, token batches and micro-batches
Beside them: checkpoint, faults, logs, memory, plugins (a user's functions), tracking
(MLflow), code_version (the tasks' cache versions), report and ablation (benchmarks), cli.
The layers are checked by import-linter (pyproject.toml, `make lint`).
"""

from dapo import moved

moved.install()
