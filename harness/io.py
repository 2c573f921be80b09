"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Every file the harness writes (configs, status, metrics, results, tables) goes through here, so a SIGKILL at any
moment leaves only complete files behind. A write goes to a hidden temporary file beside its target
(``.NAME.HOST-PID.RANDOM.tmp``) and is renamed into place; the name says which process wrote it, so the next
run can remove what a killed writer left behind (``remove_stale_temps``) without touching a live writer's file.
Files get the permissions ``open`` would give them (``0666`` less the umask), so a group can read shared results.
A full disk ends as ``DiskFull``, one sentence saying how much space the write needed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.errors import DepthmemError, UsageError

# errno values that mean "the file system has no room": out of blocks or inodes, or over a quota.
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# A temp file from another host is left alone unless nothing has written to it for this long: a live writer
# keeps touching it, a killed one does not.
FOREIGN_TEMP_AGE_S = 15 * 60


class DiskFull(DepthmemError):
    """A write failed because its file system is out of space (or over a quota)."""


class DamagedFile(UsageError):
    """A file the harness wrote earlier no longer parses (edited, truncated or overwritten outside it)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path} is damaged ({reason}).")


def current_umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only be read by setting it, which races
    with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(paths) -> None:
    """Give each file of ``paths`` the mode ``open`` would have given it under the umask.

    Writers outside the harness (safetensors' weights) create files through a temporary file of mode 0600, which
    colleagues sharing a results folder cannot read.
    """
    mode = 0o666 & ~current_umask()
    for path in map(Path, paths):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            os.chmod(path, mode)


def human_bytes(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def no_space_message(path: str | os.PathLike, size: int, *, replaces: int = 0) -> str:
    """One sentence: how much room the write of ``size`` bytes to ``path`` needs and how much there is."""
    free = free_bytes(Path(path).parent)
    have = f"; {human_bytes(free)} is free there" if free is not None else ""
    beside = (
        f" (the new copy is written beside the old one of {human_bytes(replaces)}, so until it is renamed "
        f"into place the file takes twice its size)"
        if replaces
        else ""
    )
    return (
        f"No space left to write {path}: it needs {human_bytes(size)}{beside}{have}. Free some space on that "
        "disk or write elsewhere, then run the same command again."
    )


def check_checkpoint_room(path: str | os.PathLike, size: int) -> None:
    """Fail before training when the disk of ``path`` cannot hold the checkpoints of ``size`` bytes it will write.

    Each save writes the new checkpoint beside the previous one and renames it over it, so at the moment of the
    rename the file takes twice its size.
    """
    path = Path(path)
    old = path.stat().st_size if path.is_file() else 0
    free = free_bytes(path.parent)
    need = max(2 * size - old, size)
    if free is not None and free < need:
        raise DiskFull(
            f"Not enough space for the checkpoints of this run in {path.parent}: a checkpoint takes "
            f"about {human_bytes(size)} and is written beside the previous one, so it needs "
            f"{human_bytes(2 * size)} in all and {human_bytes(need)} free; {human_bytes(free)} is free. "
            "Free some space or choose another --out."
        )


def _temp_prefix(name: str) -> str:
    host = socket.gethostname().split(".")[0].replace(".", "-") or "host"
    return f".{name}.{host}-{os.getpid()}."


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600 whatever the umask; give it what ``open`` would have.
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            old = path.stat().st_size if path.is_file() else 0
            raise DiskFull(no_space_message(path, len(data), replaces=old)) from None
        raise
    return path


def append_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Append ``data`` to ``path`` in one ``write`` call on an ``O_APPEND`` descriptor.

    A killed process leaves a regular file's single ``write`` either done or not done, so a line appended whole
    is never seen cut short; durability comes from ``fsync_path`` at the points that must survive a power loss.
    """
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # the umask applies, as with open
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise DiskFull(no_space_message(path, len(data))) from None
        raise
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


CHECKSUM_SUFFIX = ".sha256"


def checksum_path(path: str | os.PathLike) -> Path:
    """Where the SHA-256 of a file written with ``atomic_write_checked`` is kept: ``summary.json.sha256``."""
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def recorded_digests(path: str | os.PathLike) -> list[str]:
    """The digests that ``path``'s checksum file allows (none without one: a file written before checksums)."""
    try:
        return checksum_path(path).read_text().split()
    except FileNotFoundError:
        return []


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_checked(path: str | os.PathLike, data: bytes) -> Path:
    """``atomic_write_bytes`` with the SHA-256 of ``data`` written beside it, for the files whose numbers a report
    rests on: bytes that change on disk after saving (a copy cut short, a stray edit, a bad sector) are then named
    at load instead of read as results.

    The checksum file lists the new digest beside the current one until the new bytes are in place, so a kill at
    any point leaves a file that its checksum file accepts.
    """
    path = Path(path)
    digest = hashlib.sha256(data).hexdigest()
    current = recorded_digests(path)
    atomic_write_text(checksum_path(path), "\n".join([digest, *current]) + "\n")
    atomic_write_bytes(path, data)
    atomic_write_text(checksum_path(path), digest + "\n")
    return path


def matches_checksum(data: bytes, recorded: list[str]) -> bool | None:
    """Whether ``data`` is what was saved: True or False, None where no checksum was recorded."""
    return hashlib.sha256(data).hexdigest() in recorded if recorded else None


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj: Any) -> bytes:
    """The harness's JSON layout: indented, keys sorted, anything else as its ``str``."""
    return (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8")


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, json_bytes(obj))


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def remove_stale_temps(*folders: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that killed writers left in ``folders``; returns what was removed.

    A temp file of this host is removed when the process that wrote it is gone; one of another host (a shared
    file system) or without a writer in its name, when nothing has written to it for ``FOREIGN_TEMP_AGE_S``.
    """
    host = socket.gethostname().split(".")[0].replace(".", "-") or "host"
    removed = []
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if not (is_temp_name(entry.name) and entry.is_file(follow_symlinks=False)):
                continue
            if not _writer_is_gone(entry, host):
                continue
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
    return removed


def _writer_is_gone(entry: os.DirEntry, host: str) -> bool:
    parts = entry.name[1 : -len(".tmp")].split(".")
    writer = parts[-2] if len(parts) >= 3 else ""
    who, _, pid = writer.rpartition("-")
    if who == host and pid.isdigit():
        if int(pid) == os.getpid():
            return False  # this process may be writing it right now
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        return time.time() - entry.stat(follow_symlinks=False).st_mtime > FOREIGN_TEMP_AGE_S
    except OSError:
        return False


def writable_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """Create ``path`` if needed and check that files can be written in it, before any work starts.

    Checked up front so that an hour of training or evaluation never ends on an unwritable folder.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"The {what} {str(path)!r} is a file, not a folder: give a folder path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise DiskFull(
                f"No space left to create the {what} {str(path)!r}: free some space on that disk or write elsewhere."
            ) from None
        raise UsageError(f"Cannot create the {what} {str(path)!r}: {e.strerror or e}.") from None
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"The {what} {str(path)!r} is not a writable folder.")
    return path


def check_creatable(path: str | os.PathLike, what: str = "output folder") -> Path:
    """Check, creating nothing, that ``path`` is a writable folder or can be made one: what a dry run checks of a
    folder the real run would create."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"The {what} {str(path)!r} is a file, not a folder: give a folder path.")
    nearest = path
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise UsageError(f"Cannot create the {what} {str(path)!r}: {str(nearest)!r} is a file, not a folder.")
    if not os.access(nearest, os.W_OK | os.X_OK):
        where = "" if nearest == path else f" (its nearest existing folder {str(nearest)!r} is not writable)"
        raise UsageError(f"The {what} {str(path)!r} is not a writable folder{where}.")
    return path


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """Read a JSON file, or return ``default`` when it does not exist; ``DamagedFile`` when it does not parse."""
    try:
        raw = Path(path).read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # a path through a file does not exist either
        return default
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DamagedFile(path, f"not UTF-8 text: byte {raw[e.start]:#04x} at offset {e.start}") from None
    except json.JSONDecodeError as e:
        what = "empty" if not raw.strip() else f"not valid JSON: {e.msg} at line {e.lineno}"
        raise DamagedFile(path, what) from None
