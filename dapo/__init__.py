"""DAPO: the algorithm and its execution, free of Flyte (tasks/ and workflows/ hold the Flyte code).

Packages in layers, each importing only those below it (import-linter's contract in
pyproject.toml, run by `make lint`; docs/architecture.md has the map):
    cli         python -m dapo config
    resolve     the whole-run checks before any work
    cluster     what a run costs and whether its timeouts cover it (cluster_cost, run_budget)
    execution   per-stage steps (stages/), colocated chunks (colocated, overlap), schedule
    engines     rollout engines, trainers, and the policy update that drives a trainer
    model | rewards
                the policy's sources; the verifiers and scorers (neither imports the other)
    data        the prompt data and reasoning-gym's tasks
    config      the run's typed configuration: schema, presets, the override parser
    algorithm   DAPO's formulas: loss, advantages, the dynamic-sampling filter, rollout
                correction, token batches and micro-batches
Beside them, importable from any layer: checkpoint, faults, logs, memory, plugins (a user's
functions), tracking (MLflow), code_version (the tasks' cache versions), report and
ablation (benchmarks), and moved (the old module names, for one release).
"""

from dapo import moved

moved.install()
