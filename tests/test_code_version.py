"""Each task's cache version follows the project source it runs (dapo.code_version): an
edit of comments, docstrings or layout keeps it, a changed formula changes it, and the
pods (which import the fast-registered copy of the source) compute the version that
registration put in the task templates."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import tarfile
import tokenize
from pathlib import Path

from flytekit.constants import CopyFileDetection
from flytekit.tools.fast_registration import FastPackageOptions, fast_package

from dapo.code_version import canonical_source, module_closure, source_version

ROOT = Path(__file__).resolve().parents[1]
LOSS = (ROOT / "dapo" / "algorithm" / "loss.py").read_text()
TASK_MODULES = ["tasks.data", "tasks.rollout", "tasks.train", "tasks.evaluate", "tasks.tracking"]


def reworded(source: str) -> str:
    """The same code with other docstrings, other and more comments, and another layout
    (tokenize's spacing, a blank line after every statement)."""
    docstrings = {node.body[0].value.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                  and isinstance(node.body[0].value.value, str)}
    tokens = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and token.start[0] in docstrings:
            tokens.append((token.type, '"""Reworded."""'))
        elif token.type == tokenize.COMMENT:
            tokens.append((token.type, "# reworded"))
        elif token.type == tokenize.NEWLINE:
            tokens += [(tokenize.COMMENT, "# a new comment"), (token.type, token.string), (tokenize.NL, "\n")]
        else:
            tokens.append((token.type, token.string))
    return tokenize.untokenize(tokens)


def test_comments_docstrings_and_layout_keep_the_version():
    edited = reworded(LOSS)
    assert "# a new comment" in edited and '"""Reworded."""' in edited and "\n\n\n" in edited
    compile(edited, "loss.py", "exec")
    assert canonical_source(edited) == canonical_source(LOSS)


def test_a_changed_formula_changes_the_version():
    assert "1.0 - clip_low" in LOSS  # the lower bound of the decoupled clip, 1 - eps_low
    assert canonical_source(LOSS.replace("1.0 - clip_low", "1.0 - 2 * clip_low", 1)) != canonical_source(LOSS)
    assert canonical_source(LOSS.replace("import torch", "import torch\nEXTRA = 1", 1)) != canonical_source(LOSS)


def test_a_task_depends_on_the_modules_it_runs_and_not_on_others():
    train = module_closure("tasks.train")
    assert {"dapo.algorithm.loss", "dapo.engines.update", "dapo.engines.trainer.deepspeed_backend", "tasks.common"} <= set(train)
    scoring = "dapo.execution.stages.scoring"  # the rewards' overlong and format terms
    assert scoring in module_closure("tasks.rollout") and scoring in train and scoring not in module_closure("tasks.data")
    # the cached data tasks run neither the run's resolution (tasks.config) nor the advantages or the rewards
    assert not {"dapo.resolve", "dapo.algorithm.advantages", "dapo.rewards"} & set(module_closure("tasks.data"))
    assert len({source_version(module) for module in TASK_MODULES}) == len(TASK_MODULES)


def run_in_copy(root: Path, code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


VERSIONS_IN_A_POD = f"""
import importlib, json
import dapo
from dapo.code_version import source_version
from tasks import data, evaluate, rollout, tracking, train
print(json.dumps({{"dapo": dapo.__file__, "versions": {{m: source_version(m) for m in {TASK_MODULES!r}}},
                  "rollout_task": rollout.rollout.metadata.cache_version, "policy_step": train.policy_step.metadata.cache_version}}))
"""


def test_the_pods_compute_the_versions_registration_put_in_the_templates(tmp_path):
    from flytekit.tools.translator import get_serializable
    from flytekit.configuration import Image, ImageConfig, SerializationSettings
    from collections import OrderedDict

    from tasks import rollout, train

    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="d", fqn="d", tag="t")))
    registered = {task.name: get_serializable(OrderedDict(), settings, task).template.metadata.discovery_version
                  for task in (rollout.rollout, train.policy_step)}
    # the tree as `pyflyte run --remote --copy all` ships it, unpacked where the pod runs
    tarball = fast_package(ROOT, tmp_path, options=FastPackageOptions([], copy_style=CopyFileDetection.ALL))
    pod_root = tmp_path / "root"
    with tarfile.open(tarball) as archive:
        archive.extractall(pod_root, filter="data")
    pod = run_in_copy(pod_root, VERSIONS_IN_A_POD)
    assert Path(pod["dapo"]).is_relative_to(pod_root)
    assert pod["versions"] == {module: source_version(module) for module in TASK_MODULES}
    assert (pod["rollout_task"], pod["policy_step"]) == (registered[rollout.rollout.name], registered[train.policy_step.name])

    # a comment-only edit there keeps every version; a changed formula changes those of the tasks that run it
    loss = pod_root / "dapo" / "algorithm" / "loss.py"
    loss.write_text(reworded(LOSS))
    assert run_in_copy(pod_root, VERSIONS_IN_A_POD)["versions"] == pod["versions"]
    loss.write_text(LOSS)
    scoring = pod_root / "dapo" / "execution" / "stages" / "scoring.py"
    formula = "reward.overlong_penalty_factor if reward.enable_overlong_penalty"  # the soft overlong punishment's factor
    assert formula in scoring.read_text()
    scoring.write_text(scoring.read_text().replace(formula, "2 * reward.overlong_penalty_factor if reward.enable_overlong_penalty"))
    changed = run_in_copy(pod_root, VERSIONS_IN_A_POD)["versions"]
    assert changed["tasks.rollout"] != pod["versions"]["tasks.rollout"] and changed["tasks.train"] != pod["versions"]["tasks.train"]
    assert changed["tasks.data"] == pod["versions"]["tasks.data"]  # data preparation scores no response
