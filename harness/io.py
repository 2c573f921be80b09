"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every file the harness writes (configs, status, metrics, results, tables) goes through here, so a SIGKILL at any
moment leaves only complete files behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def append_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Append ``data`` to ``path`` in one ``write`` call on an ``O_APPEND`` descriptor.

    A killed process leaves a regular file's single ``write`` either done or not done, so a line appended whole
    is never seen cut short; durability comes from ``fsync_path`` at the points that must survive a power loss.
    """
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush ``path``'s data to disk (a file appended to with ``append_bytes``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def writable_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """Create ``path`` if needed and check that files can be written in it, before any work starts.

    Checked up front so that an hour of training or evaluation never ends on an unwritable folder.
    """
    from harness.errors import UsageError

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"Cannot create the {what} {str(path)!r}: {e.strerror or e}.") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"The {what} {str(path)!r} is not a writable folder.")
    return path


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """Read a JSON file, or return ``default`` when it does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
