"""A run killed while DeepSpeed JIT-builds its CPU comm op never hangs the next one
(dapo.engines.trainer.comm_op): torch's build lock names no owner, ours is an flock the kernel drops."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo.engines.trainer.comm_op import BUILD_DELAY_ENV, exclusive
from machine_caches import torch_extensions_dir

pytestmark = pytest.mark.deepspeed
OP = "deepspeed_shm_comm"
REPO = Path(__file__).resolve().parent.parent


def start(env: dict[str, str], log: Path, code: str = "") -> subprocess.Popen:
    """`python -m dapo.engines.trainer.comm_op` (or `code`), its output in `log`, in a process group of its own."""
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "dapo.engines.trainer.comm_op"]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.1)


def finished(process: subprocess.Popen, log: Path, timeout_s: float = 400) -> str:
    process.wait(timeout=timeout_s)
    output = log.read_text()
    assert process.returncode == 0, output
    return output


@pytest.fixture
def extensions(tmp_path) -> Path:
    """A TORCH_EXTENSIONS_DIR of the test's own, holding the op `make setup` built when there
    is one (a start then loads it in seconds; without it the first start builds it, ~1 min)."""
    built = Path(torch_extensions_dir()) / OP
    if (built / f"{OP}.so").exists():
        shutil.copytree(built, tmp_path / OP, ignore=shutil.ignore_patterns("lock"))
    return tmp_path


def test_a_start_killed_inside_torchs_build_lock_does_not_hang_the_next_one(extensions, tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    killed = start({**env, BUILD_DELAY_ENV: "600"}, tmp_path / "killed.log")  # sleeps inside torch's lock, as a slow compile would
    torch_lock = extensions / OP / "lock"
    wait_for(torch_lock.exists, "torch's build lock", timeout_s=120)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert torch_lock.exists()  # what a killed build leaves

    # DeepSpeed's own load (deepspeed.comm.build_shm_op) waits on it, silently, for ever
    deepspeeds_own = start(env, tmp_path / "own.log", "from deepspeed.accelerator import get_accelerator\n"
                                                     "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    with pytest.raises(subprocess.TimeoutExpired):
        deepspeeds_own.wait(timeout=8)
    os.killpg(deepspeeds_own.pid, signal.SIGKILL)
    deepspeeds_own.wait()

    output = finished(start(env, tmp_path / "again.log"), tmp_path / "again.log")
    assert f"removing {torch_lock}" in output and "a build of deepspeed_shm_comm killed before it ended" in output
    assert not torch_lock.exists() and (extensions / OP / f"{OP}.so").exists()


def test_a_start_says_whom_it_waits_for_while_another_builds(extensions, tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    (extensions / OP).mkdir(exist_ok=True)
    log = tmp_path / "waiting.log"
    notice = f"waiting for the build of DeepSpeed's {OP} op in {extensions / OP} by process {os.getpid()}"
    with exclusive(extensions / f"{OP}.dapo-lock", "a test's build"):
        waiting = start(env, log)
        wait_for(lambda: notice in log.read_text(), "the notice", timeout_s=120)
        assert waiting.poll() is None  # it waits while we hold the lock
    finished(waiting, log)
