"""Fixtures shared by test modules, and the order test files are handed to `make test`'s workers."""

import pytest

from servers import start_s3, stop

LONGEST_FILES_FIRST = ("test_pod_simulation.py", "test_reruns.py", "test_real_model.py", "test_workflow_local.py", "test_learning.py",
                       "test_tracking.py", "test_colocated.py")
"""The files that take minutes (pytest --durations), handed out first: with a file to a worker
(--dist loadfile) in collection order, the longest one collected last (alphabetical) kept
one worker busy for minutes after the other had run out of work."""


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The endpoint of an S3 server on loopback (moto) with the bucket servers.BUCKET."""
    process, endpoint = start_s3(tmp_path_factory.mktemp("moto"))
    try:
        yield endpoint
    finally:
        stop(process)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> str:
    """The tiny policy, built once per pytest session (policy_steps.shared_tiny_policy)."""
    from policy_steps import shared_tiny_policy

    return shared_tiny_policy(tmp_path_factory)
