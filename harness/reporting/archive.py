"""A sweep as one file: ``pack`` writes its run directories into a deterministic ``.tar.xz``, and the sources here
let ``load_sweep`` and the report read a sweep folder and such an archive alike.

An archive holds, relative to the sweep folder, every file of every run directory (a folder holding a
``config.json``, found recursively), every ``tuning.json`` (the tuning stage's choices) and every ``sweep.json``
(the manifest a sweep writes) under the sweep. It leaves out checkpoints (``ckpt/`` folders and ``*.ckpt``, ``*.pt``,
``*.pth``, ``*.safetensors`` files), lock files, the temporary files of interrupted writes, links, and any file over
``MAX_MEMBER_BYTES``: what a report reads is kept, what only resumes or reloads a model is not. The same files give
the same archive byte for byte: members sorted by path, each with mode 0644, owner 0 and modification time 0.
"""

from __future__ import annotations

import gzip
import io
import lzma
import posixpath
import tarfile
import zlib
from pathlib import Path, PurePosixPath

from harness.errors import UsageError
from harness.io import atomic_write_bytes, is_temp_name

ARCHIVE_SUFFIXES = (".tar.xz", ".tar.gz", ".tgz")
MAX_MEMBER_BYTES = 4_000_000
SKIPPED_SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors", ".lock")
KEPT_OUTSIDE_RUNS = ("tuning.json", "sweep.json")


def is_archive(path: str | Path) -> bool:
    """Whether ``path`` names a sweep archive (by its suffix; the file need not exist)."""
    return str(path).endswith(ARCHIVE_SUFFIXES)


def archive_stem(path: str | Path) -> str:
    """The archive's file name without its suffix: ``study-runs`` for ``study-runs.tar.xz``."""
    name = Path(path).name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _parts(rel: str) -> tuple[str, ...]:
    return PurePosixPath(rel).parts  # the order of sorted paths: part by part, the folder before what it holds


def find_run_dirs(root: str | Path) -> list[Path]:
    """Every folder under ``root`` (itself included) that holds a ``config.json``, sorted by path."""
    return sorted({p.parent for p in Path(root).rglob("config.json")})


def write_tar(members: dict[str, bytes], out_path: str | Path) -> Path:
    """Write ``members`` (path inside the archive -> content) as a deterministic tar, compressed by the suffix of
    ``out_path`` (``.tar.xz``, ``.tar.gz`` or ``.tgz``), atomically."""
    out_path = Path(out_path)
    if not is_archive(out_path):
        raise UsageError(f"The archive name {str(out_path)!r} must end in .tar.xz, .tar.gz or .tgz.")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(members[name]), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(members[name]))
    data = buf.getvalue()
    if out_path.name.endswith(".tar.xz"):
        packed = lzma.compress(data, format=lzma.FORMAT_XZ, preset=6 | lzma.PRESET_EXTREME)
    else:
        packed = gzip.compress(data, compresslevel=9, mtime=0)
    return atomic_write_bytes(out_path, packed)


def _kept(path: Path, rel: PurePosixPath) -> bool:
    return (
        path.is_file()
        and not path.is_symlink()
        and "ckpt" not in rel.parts[:-1]
        and not path.name.endswith(SKIPPED_SUFFIXES)
        and not is_temp_name(path.name)
        and path.stat().st_size <= MAX_MEMBER_BYTES
    )


def sweep_members(sweep_dir: str | Path) -> dict[str, bytes]:
    """The files ``pack`` keeps, by their path relative to ``sweep_dir``."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise UsageError(f"The sweep folder {str(root)!r} does not exist: give a folder of run directories.")
    runs = find_run_dirs(root)
    if not runs:
        raise UsageError(f"No run directories (folders with a config.json) under {root}: nothing to pack.")
    paths = {p for d in runs for p in d.rglob("*")}
    paths |= {p for name in KEPT_OUTSIDE_RUNS for p in root.rglob(name)}
    members = {}
    for path in paths:
        rel = PurePosixPath(path.relative_to(root).as_posix())
        if _kept(path, rel):
            members[str(rel)] = path.read_bytes()
    return members


def pack(sweep_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Write the sweep at ``sweep_dir`` into one archive (default ``<sweep folder>.tar.xz`` beside it)."""
    sweep_dir = Path(sweep_dir)
    folder = sweep_dir if sweep_dir.name not in ("", "..") else sweep_dir.resolve()
    out = Path(out_path) if out_path is not None else folder.parent / f"{folder.name}.tar.xz"
    return write_tar(sweep_members(sweep_dir), out)


class FolderSource:
    """A sweep folder's files, by their path relative to it."""

    def __init__(self, root: str | Path):
        self.root, self.name, self.notes = Path(root), Path(root).name, []

    def run_dirs(self) -> list[str]:
        return [d.relative_to(self.root).as_posix() for d in find_run_dirs(self.root)]

    def find(self, name: str) -> list[str]:
        return sorted((p.relative_to(self.root).as_posix() for p in self.root.rglob(name)), key=_parts)

    def read_bytes(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def path(self, rel: str) -> Path:
        return self.root / rel


class ArchiveSource(FolderSource):
    """A sweep archive's files, read into memory once; ``path`` gives a path inside the archive."""

    def __init__(self, root: str | Path):
        super().__init__(root)
        self.name, self.files = archive_stem(root), {}
        try:
            with tarfile.open(self.root, "r:*") as tar:
                for info in tar:
                    name = posixpath.normpath(info.name.lstrip("/"))
                    if info.isfile() and not name.startswith("../"):
                        self.files[name] = tar.extractfile(info).read()
        except (tarfile.TarError, lzma.LZMAError, zlib.error, EOFError, OSError) as e:
            if not self.files:
                reason = (str(e).splitlines() or [""])[0].rstrip(": ") or "no tar archive"
                raise UsageError(
                    f"The sweep archive {self.root} cannot be read ({type(e).__name__}: {reason}); give a .tar.xz "
                    "that `depthmem pack` wrote, or a sweep folder."
                ) from None
            self.notes.append(
                f"The archive {self.root.name} is damaged after its first {len(self.files)} files "
                f"({type(e).__name__}): the runs stored after them are missing or incomplete."
            )

    def run_dirs(self) -> list[str]:
        return sorted({posixpath.dirname(n) or "." for n in self.find("config.json")}, key=_parts)

    def find(self, name: str) -> list[str]:
        return sorted((n for n in self.files if posixpath.basename(n) == name), key=_parts)

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.files[posixpath.normpath(rel)]
        except KeyError:
            raise FileNotFoundError(rel) from None

    def exists(self, rel: str) -> bool:
        return posixpath.normpath(rel) in self.files

    def path(self, rel: str) -> PurePosixPath:
        return PurePosixPath(rel)


def open_source(root: str | Path) -> FolderSource:
    """The files of a sweep: an archive's when ``root`` is an archive file, else the folder's."""
    return ArchiveSource(root) if is_archive(root) and Path(root).is_file() else FolderSource(root)
