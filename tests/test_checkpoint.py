"""Atomic checkpoint directories (dapo.checkpoint) and the trainer's use of them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dapo import checkpoint

REPO = Path(__file__).resolve().parents[1]


def write_files(directory: str | Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = Path(directory) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def scratch_dirs(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if checkpoint.TMP_MARK in p.name or checkpoint.OLD_MARK in p.name]


FILES = {"config.json": b"{}", "model.safetensors": b"\x00" * 1000, "trainer_state/optimizer.pt": b"adam"}


def test_atomic_dir_commits_files_and_marker(tmp_path):
    final = tmp_path / "step_0003"
    with checkpoint.atomic_dir(final, step=3, extra={"note": "x"}) as scratch:
        assert checkpoint.TMP_MARK in Path(scratch).name and Path(scratch).parent == tmp_path
        assert not final.exists()
        write_files(scratch, FILES)
    assert checkpoint.is_complete(final) and checkpoint.is_complete(final, verify=True)
    marker = checkpoint.read_marker(final)
    assert marker["step"] == 3 and marker["extra"] == {"note": "x"}
    assert set(marker["files"]) == set(FILES)
    assert checkpoint.recorded_hash(final) == checkpoint.content_hash(final)
    assert scratch_dirs(tmp_path) == []


def test_exception_mid_write_leaves_no_complete_looking_dir(tmp_path):
    previous = tmp_path / "step_0001"
    with checkpoint.atomic_dir(previous, step=1) as scratch:
        write_files(scratch, FILES)
    target = tmp_path / "step_0002"
    with pytest.raises(RuntimeError, match="disk full"):
        with checkpoint.atomic_dir(target, step=2) as scratch:
            write_files(scratch, {"config.json": b"{}"})
            raise RuntimeError("disk full")
    assert not target.exists()
    assert scratch_dirs(tmp_path) == []
    assert checkpoint.latest_complete(tmp_path) == str(previous)


def test_killed_writer_leaves_only_an_incomplete_scratch_dir(tmp_path):
    previous = tmp_path / "step_0001"
    with checkpoint.atomic_dir(previous, step=1) as scratch:
        write_files(scratch, FILES)
    # A real crash: the process dies (no exception handler, no cleanup) mid-write.
    code = textwrap.dedent(
        f"""
        import os
        from dapo import checkpoint
        with checkpoint.atomic_dir({str(tmp_path / "step_0002")!r}, step=2) as scratch:
            open(os.path.join(scratch, "config.json"), "w").write("{{}}")
            os._exit(9)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 9
    leftovers = scratch_dirs(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].startswith("step_0002" + checkpoint.TMP_MARK)
    assert not (tmp_path / "step_0002").exists()
    assert not checkpoint.is_complete(tmp_path / leftovers[0])
    assert checkpoint.latest_complete(tmp_path) == str(previous)
    assert checkpoint.remove_stale_tmp(tmp_path, older_than_s=3600) == []  # too fresh to be called stale
    assert checkpoint.remove_stale_tmp(tmp_path) == [str(tmp_path / leftovers[0])]
    assert scratch_dirs(tmp_path) == []


def test_is_complete_checks_listed_files(tmp_path):
    final = tmp_path / "ckpt"
    with checkpoint.atomic_dir(final, step=0) as scratch:
        write_files(scratch, FILES)
    assert checkpoint.is_complete(final)
    (final / "model.safetensors").write_bytes(b"\x01" * 1000)  # same size, other bytes
    assert checkpoint.is_complete(final) and not checkpoint.is_complete(final, verify=True)
    (final / "model.safetensors").write_bytes(b"\x00" * 10)  # truncated
    assert not checkpoint.is_complete(final)
    (final / "model.safetensors").unlink()
    assert not checkpoint.is_complete(final)
    assert not checkpoint.is_complete(tmp_path / "missing")
    plain = tmp_path / "no-marker"
    write_files(plain, FILES)
    assert not checkpoint.is_complete(plain)
    (plain / checkpoint.COMPLETE_FILE).write_text("{not json")
    assert not checkpoint.is_complete(plain)


def test_content_hash_depends_on_names_and_bytes_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_files(a, FILES)
    write_files(b, dict(reversed(list(FILES.items()))))
    os.utime(b / "config.json", (1, 1))
    assert checkpoint.content_hash(a) == checkpoint.content_hash(b)
    checkpoint.write_marker(a, step=5)  # the marker itself is not content
    assert checkpoint.content_hash(a) == checkpoint.content_hash(b)
    (b / "config.json").write_bytes(b"[]")
    changed_bytes = checkpoint.content_hash(b)
    assert changed_bytes != checkpoint.content_hash(a)
    (b / "config.json").write_bytes(b"{}")
    (b / "config.json").rename(b / "config2.json")
    assert checkpoint.content_hash(b) not in (changed_bytes, checkpoint.content_hash(a))
    with pytest.raises(FileNotFoundError):
        checkpoint.content_hash(tmp_path / "missing")


def test_latest_complete_orders_by_step_not_name(tmp_path):
    assert checkpoint.latest_complete(tmp_path) is None
    assert checkpoint.latest_complete(tmp_path / "missing") is None
    for step in (2, 10, 9):
        with checkpoint.atomic_dir(tmp_path / f"step_{step}", step=step) as scratch:
            write_files(scratch, {"w": str(step).encode()})
    write_files(tmp_path / "step_11", {"w": b"no marker"})  # incomplete
    write_files(tmp_path / "notes", {})
    assert checkpoint.latest_complete(tmp_path) == str(tmp_path / "step_10")


def test_overwrite_replaces_and_can_be_refused(tmp_path):
    final = tmp_path / "ckpt"
    with checkpoint.atomic_dir(final, step=1) as scratch:
        write_files(scratch, {"w": b"old", "stale": b"x"})
    with checkpoint.atomic_dir(final, step=2) as scratch:
        write_files(scratch, {"w": b"new"})
    assert (final / "w").read_bytes() == b"new" and not (final / "stale").exists()
    assert checkpoint.read_marker(final)["step"] == 2
    with pytest.raises(FileExistsError):
        with checkpoint.atomic_dir(final, step=3, overwrite=False) as scratch:
            write_files(scratch, {"w": b"newer"})
    assert (final / "w").read_bytes() == b"new"
    assert scratch_dirs(tmp_path) == []


def test_trainer_save_crash_keeps_the_previous_checkpoint(tmp_path_factory, tmp_path, monkeypatch):
    from policy_steps import make_config, scored_table, shared_tiny_policy
    from dapo.engines.trainer import make_trainer
    from dapo.engines.update import policy_update

    policy_dir = shared_tiny_policy(tmp_path_factory)
    config = make_config()
    trainer = make_trainer(config, policy_dir)
    try:
        policy_update(trainer, scored_table(groups=2), config, step=0, temperature=1.0)
        trainer.save(tmp_path / "step_0000")
        policy_update(trainer, scored_table(groups=2, seed=1), config, step=1, temperature=1.0)

        def crash(state_dir):
            Path(state_dir, "optimizer.pt").write_bytes(b"half written")
            raise OSError("simulated crash while writing the optimizer state")

        monkeypatch.setattr(trainer, "_save_optimizer", crash)
        with pytest.raises(OSError, match="simulated crash"):
            trainer.save(tmp_path / "step_0001")
    finally:
        trainer.close()
    assert not (tmp_path / "step_0001").exists()
    assert scratch_dirs(tmp_path) == []
    assert checkpoint.latest_complete(tmp_path) == str(tmp_path / "step_0000")
    marker = checkpoint.read_marker(tmp_path / "step_0000")
    assert marker["step"] == 0 and marker["extra"]["backend"] == "torch"
    assert "trainer_state/optimizer.pt" in marker["files"] and "model.safetensors" in marker["files"]
    assert checkpoint.is_complete(tmp_path / "step_0000", verify=True)
