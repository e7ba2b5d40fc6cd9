"""A run's whole-run checks, above the schema: dapo.config checks each field and the rules
between fields (plain data); resolving a run also loads the user's functions it names,
reads its data and model sources, prices its timeouts against its work (dapo.cluster.run_budget)
and records the digest of the user's code, before any other work (tasks.config.resolve_config)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from dapo.algorithm.advantages import ADVANTAGE_ESTIMATORS
from dapo.algorithm.loss import POLICY_LOSSES
from dapo.cluster.run_budget import check_run_budget
from dapo.config import ConfigError, DAPOConfig
from dapo.data.gym_tasks import DATA_SOURCE as GYM_DATA_SOURCE
from dapo.data.gym_tasks import is_gym_spec, parse_spec
from dapo.model.model_source import hub_commit, is_hub_name, model_digest, parameter_count
from dapo.plugins import PluginError, named_functions, resolve, user_code_digest
from dapo.rewards import SCORERS

logger = logging.getLogger(__name__)


def resolve_run(config: DAPOConfig) -> DAPOConfig:
    """The config a run starts with: the functions it names loaded (check_named_functions),
    its sources read (resolve_sources), its timeouts covering its work (check_run_budget,
    with the model's size as read), and the digest of the user's code (user_code_digest)."""
    check_named_functions(config)
    config = resolve_sources(config)  # reads the data spec and the model's headers (a hub model: from the hub)
    check_run_budget(config)
    return config.replace(user_code_digest=user_code_digest(config))


def check_named_functions(config: DAPOConfig) -> None:
    """Load every function the config names (named_functions), so that a misspelt one fails
    when the run starts, naming its field, not steps later. Here, above the registries
    it reads (dapo.rewards, dapo.algorithm.loss, dapo.algorithm.advantages), not in dapo.plugins,
    which they import."""
    registries: dict[str, Mapping[str, Callable]] = {
        "scorer": SCORERS,
        "policy loss": POLICY_LOSSES,
        "advantage estimator": ADVANTAGE_ESTIMATORS,
    }
    for field, spec, kind in named_functions(config):
        try:
            resolve(spec, registries[kind], kind)
        except PluginError as error:
            raise ConfigError(f"DAPOConfig.{field}: {error}") from error


def resolve_sources(config: DAPOConfig) -> DAPOConfig:
    """The config with its data and model sources checked before any work: a reasoning_gym:
    spec's tasks and options (GymSpecError names the closest), its rows scored by the
    reasoning_gym scorer unless reward_fn_by_source says otherwise; a GGUF model's file
    (ModelSourceError) and its digest in model_digest; a hub model's revision pinned to its
    commit; the model's parameters in model_size_billions unless given (read from its headers)."""
    by_source = dict(config.reward_fn_by_source)
    for path in (config.train_data_path, config.val_data_path):
        if is_gym_spec(path):
            parse_spec(path)
            by_source.setdefault(GYM_DATA_SOURCE, GYM_DATA_SOURCE)
    config = config.replace(reward_fn_by_source=by_source, model_digest=model_digest(config.model_path))
    if is_hub_name(config.model_path):
        commit = hub_commit(config.model_path, config.model_revision)
        logger.info("model %s: revision %r is commit %s", config.model_path, config.model_revision or "main", commit)
        config = config.replace(model_revision=commit)
    if config.model_path and not config.model_size_billions:
        config = config.replace(model_size_billions=parameter_count(config.model_path, config.model_revision) / 1e9)
    return config
