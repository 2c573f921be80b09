"""``depthmem pack SWEEP``: a sweep's run directories as one deterministic archive that ``depthmem report`` reads."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "pack",
        help="write a sweep's run directories into one .tar.xz that `depthmem report` reads",
        description="Pack the results of a sweep's run directories (not their checkpoints) into one deterministic "
        "archive, the form in which a finished study is kept or committed; `depthmem report ARCHIVE --out FOLDER` "
        "reads it as it reads the folder.",
    )
    p.add_argument("sweep", metavar="SWEEP", help="the sweep folder (a folder of run directories)")
    p.add_argument(
        "--out", metavar="FILE", help="the archive to write, .tar.xz, .tar.gz or .tgz (default: SWEEP.tar.xz beside it)"
    )
    return p


def run(args) -> int:
    # Imported here, not at the top, so the CLI starts without loading pandas.
    from harness.io import human_bytes
    from harness.reporting.archive import pack

    path = pack(args.sweep, args.out)
    print(f"{path} ({human_bytes(path.stat().st_size)})")
    return 0
