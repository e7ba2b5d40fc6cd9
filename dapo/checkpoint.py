"""Atomic checkpoint directories.

A checkpoint is written into a sibling temporary directory ``<dir>.tmp-<random>``
and moved into place with ``os.replace`` only when every file is on disk. The last
file written before the move is ``COMPLETE``, a small JSON marker holding the step,
each file's size and sha256, and the directory's content hash. So:

- a crash (or exception) mid-write never leaves ``<dir>`` itself: what remains is a
  ``.tmp-`` directory without a marker, which ``is_complete`` rejects and
  ``latest_complete`` skips (``remove_stale_tmp`` deletes such leftovers);
- ``content_hash(dir)`` is a stable sha256 over file names and bytes (the marker
  excluded), fit for a Flyte cache key; ``recorded_hash(dir)`` reads it back from
  the marker without re-reading the weights.

Overwriting an existing ``<dir>`` moves the old one aside (``<dir>.old-<random>``),
moves the new one in, then deletes the old one: a crash between the two renames
leaves no ``<dir>`` (never a half-written one).

Usage::

    with atomic_dir("ckpt/step_000005", step=5) as tmp:
        model.save_pretrained(tmp)

or, where several processes write parts of one checkpoint, ``new_tmp_dir`` on one
process, the writes on all, then ``commit`` (or ``abort``) on that one process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dapo.faults import crash_point

logger = logging.getLogger(__name__)

COMPLETE_FILE = "COMPLETE"
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
MARKER_FORMAT = 1
_CHUNK = 8 << 20


def _is_scratch_name(name: str) -> bool:
    return TMP_MARK in name or OLD_MARK in name


def _files(path: Path) -> list[Path]:
    """Every regular file under path (symlinks followed), sorted by relative posix path."""
    out = []
    for root, dirs, names in os.walk(path, followlinks=True):
        dirs.sort()
        for name in names:
            full = Path(root) / name
            if full.is_file():
                out.append(full)
    return sorted(out, key=lambda p: p.relative_to(path).as_posix())


def _hash_file(path: Path, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _combine(entries: dict[str, dict[str, Any]]) -> str:
    """The content hash from per-file (size, sha256): sha256 over name, size and file digest."""
    digest = hashlib.sha256()
    for name in sorted(entries):
        digest.update(name.encode("utf-8"))
        digest.update(b"\0")
        digest.update(str(entries[name]["size"]).encode())
        digest.update(b"\0")
        digest.update(bytes.fromhex(entries[name]["sha256"]))
        digest.update(b"\n")
    return digest.hexdigest()


def file_hashes(path: str | Path, fsync: bool = False) -> dict[str, dict[str, Any]]:
    """{relative posix path: {"size", "sha256"}} for every file except the COMPLETE marker."""
    path = Path(path)
    entries = {}
    for full in _files(path):
        name = full.relative_to(path).as_posix()
        if name == COMPLETE_FILE:
            continue
        entries[name] = {"size": full.stat().st_size, "sha256": _hash_file(full, fsync=fsync)}
    return entries


def content_hash(path: str | Path) -> str:
    """sha256 over the names and bytes of every file under path (the COMPLETE marker excluded).

    Each file contributes its relative path, its size and the sha256 of its bytes, in
    sorted path order, so the hash depends on content only, not on mtimes or on the
    directory's own name.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"not a directory: {path}")
    return _combine(file_hashes(path))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_marker(path: str | Path, step: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsync every file under path, then write COMPLETE (last) with step, file hashes and content hash."""
    path = Path(path)
    entries = file_hashes(path, fsync=True)
    marker = {
        "format": MARKER_FORMAT,
        "step": step,
        "created": time.time(),
        "content_hash": _combine(entries),
        "files": entries,
        "extra": extra or {},
    }
    tmp_marker = path / (COMPLETE_FILE + ".partial")
    with open(tmp_marker, "w") as handle:
        json.dump(marker, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp_marker, path / COMPLETE_FILE)
    _fsync_dir(path)
    return marker


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The parsed COMPLETE marker, or None when it is missing or unreadable."""
    try:
        with open(Path(path) / COMPLETE_FILE) as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return None
    return marker


def is_complete(path: str | Path, verify: bool = False) -> bool:
    """True iff path is a committed checkpoint.

    Checks the COMPLETE marker and that every file it lists exists with its recorded
    size; with verify=True also re-hashes every file (slow for large weights).
    A ``.tmp-`` / ``.old-`` scratch directory is never complete.
    """
    path = Path(path)
    if not path.is_dir() or _is_scratch_name(path.name):
        return False
    marker = read_marker(path)
    if marker is None:
        return False
    for name, entry in marker["files"].items():
        full = path / name
        try:
            if full.stat().st_size != entry["size"]:
                return False
        except OSError:
            return False
    if verify:
        return file_hashes(path) == marker["files"]
    return True


def recorded_hash(path: str | Path) -> str | None:
    """The content hash stored in the marker (equals content_hash(path) for an untouched checkpoint)."""
    marker = read_marker(path)
    return None if marker is None else marker.get("content_hash")


def latest_complete(parent_dir: str | Path) -> str | None:
    """The complete checkpoint directly under parent_dir with the highest step (ties: newest marker).

    Checkpoints whose marker has no step rank below those with one. Scratch
    directories (``.tmp-``, ``.old-``) and incomplete ones are skipped.
    """
    parent = Path(parent_dir)
    if not parent.is_dir():
        return None
    best: tuple[Any, ...] | None = None
    best_path = None
    for child in parent.iterdir():
        if not child.is_dir() or _is_scratch_name(child.name) or not is_complete(child):
            continue
        marker = read_marker(child) or {}
        step = marker.get("step")
        key = (step is not None, step if isinstance(step, (int, float)) else -1, marker.get("created", 0.0), child.name)
        if best is None or key > best:
            best, best_path = key, child
    return None if best_path is None else str(best_path)


def new_tmp_dir(final_dir: str | Path) -> str:
    """Create and return an empty sibling scratch directory ``<final_dir>.tmp-<random>``."""
    final = Path(final_dir).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{final.name}{TMP_MARK}{secrets.token_hex(6)}"
    tmp.mkdir()
    return str(tmp)


def commit(
    tmp_dir: str | Path,
    final_dir: str | Path,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> dict[str, Any]:
    """Write the marker into tmp_dir, then move it to final_dir. Returns the marker."""
    tmp = Path(tmp_dir)
    final = Path(final_dir).absolute()
    crash_point("checkpoint_commit", step)  # the reliability tests kill here: files written, not yet in place
    marker = write_marker(tmp, step=step, extra=extra)
    old = None
    if final.exists():
        if not overwrite:
            raise FileExistsError(f"{final} exists and overwrite=False")
        old = final.parent / f"{final.name}{OLD_MARK}{secrets.token_hex(6)}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return marker


def abort(tmp_dir: str | Path) -> None:
    """Delete a scratch directory (after a failed write)."""
    shutil.rmtree(tmp_dir, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(
    final_dir: str | Path,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = True,
) -> Iterator[str]:
    """Yield a scratch directory; on normal exit commit it to final_dir, on an exception delete it."""
    tmp = new_tmp_dir(final_dir)
    try:
        yield tmp
    except BaseException:
        abort(tmp)
        raise
    try:
        commit(tmp, final_dir, step=step, extra=extra, overwrite=overwrite)
    except BaseException:
        abort(tmp)
        raise


def remove_stale_tmp(parent_dir: str | Path, older_than_s: float = 0.0) -> list[str]:
    """Delete scratch directories (left by crashed writers) directly under parent_dir.

    Only those last modified more than older_than_s seconds ago, so a writer that is
    still running elsewhere can be spared. Returns the removed paths.
    """
    parent = Path(parent_dir)
    removed: list[str] = []
    if not parent.is_dir():
        return removed
    now = time.time()
    for child in parent.iterdir():
        if child.is_dir() and _is_scratch_name(child.name):
            try:
                age = now - child.stat().st_mtime
            except OSError:
                continue
            if age >= older_than_s:
                shutil.rmtree(child, ignore_errors=True)
                removed.append(str(child))
                logger.info("removed stale checkpoint scratch dir %s", child)
    return removed
