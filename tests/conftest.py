"""Fixtures shared by test modules."""

import pytest

from servers import start_s3, stop


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
