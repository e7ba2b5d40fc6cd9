"""Task helpers that move checkpoints."""

from pathlib import Path

import fsspec
from flytekit.types.directory import FlyteDirectory

from tasks.common import download_weights


def remote_checkpoint(root: str) -> FlyteDirectory:
    fs = fsspec.filesystem("memory")
    files = {"model.safetensors": b"weights", "config.json": b"{}", "trainer_state/optim.pt": b"optimizer" * 100}
    for name, data in files.items():
        fs.pipe(f"{root}/{name}", data)
    directory = FlyteDirectory(path="/nonexistent-local-copy")
    directory._remote_source = root
    return directory


def test_download_weights_leaves_the_optimizer_state_in_the_store():
    local = Path(download_weights(remote_checkpoint("memory://bucket/run/policy-3")))
    assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    assert (local / "model.safetensors").read_bytes() == b"weights"


def test_download_weights_uses_a_local_checkpoint_in_place(tmp_path):
    (tmp_path / "trainer_state").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"w")
    assert Path(download_weights(FlyteDirectory(str(tmp_path)))) == tmp_path
