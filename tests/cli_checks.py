"""What the command-line tests share: the smallest real training run, and checks of how a command ends."""

from __future__ import annotations

import textwrap

from harness.cli import main as cli_main

# The smallest real run: two steps of the tiny preset, checkpointed, so every loader has something to load.
TRAIN_ARGS = [
    "--preset",
    "tiny",
    "--max-steps",
    "2",
    "--set",
    "train.batch_size=4",
    "--set",
    "train.seq_len=32",
    "--set",
    "train.val_batches=1",
    "--set",
    "train.val_every_steps=2",
    "--set",
    "train.ckpt_every_steps=2",
    "--set",
    "train.log_every_steps=1",
]


def fails(capsys, argv: list[str], code: int = 2, max_len: int = 600) -> str:
    """Run the CLI, expect exit ``code`` and exactly one ``depthmem:`` sentence on stderr; return it."""
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == code, f"exit {rc} for {argv}: {err[-2000:]}"
    assert "Traceback" not in err
    # Progress bars of the libraries may share stderr; the error itself is one line of its own.
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.startswith("depthmem:")]
    assert len(lines) == 1, err[-2000:]
    line = lines[0]
    assert line.endswith((".", "?")) and len(line) < max_len, line
    return line


def dry_run_text(capsys, tmp_path, profile: str, variants: list[str], results) -> str:
    """What ``depthmem sweep --dry-run`` prints for a grid of the tiny preset (100 steps of 16 sequences) over
    ``variants``, under a profile whose YAML text is ``profile``, planned in the results folder ``results``."""
    path = tmp_path / "profile.yaml"
    path.write_text(profile)
    grid = tmp_path / "g.yaml"
    grid.write_text(
        textwrap.dedent(f"""
        name: g
        profile: {path}
        base: {{model: {{preset: tiny}}, train: {{max_steps: 100, batch_size: 16}}}}
        axes: {{variant: [{", ".join(variants)}]}}
        """)
    )
    assert cli_main(["sweep", str(grid), "--dry-run", "--results", str(results)]) == 0
    return capsys.readouterr().out


def tiny_train_command(variant: str, devices: int, out, train: dict) -> list[str]:
    """``depthmem train`` of ``variant`` at the tiny preset on ``devices`` processes into ``out``, with ``train``
    as ``train.KEY=VALUE`` settings: the command line a multi-process test starts (Lightning starts the other
    processes by running it again)."""
    import sys
    from pathlib import Path

    depthmem = str(Path(sys.executable).parent / "depthmem")
    command = [depthmem, "train", "--preset", "tiny", "--variant", variant, "--devices", str(devices)]
    return command + ["--out", str(out), *(f"--set=train.{k}={v}" for k, v in train.items())]


def ranks_stderr(stderr: str, keep: int = 3000) -> str:
    """What a failed multi-process run printed, for an assertion message: the end of rank 0's own lines (the
    command's process, whose lines carry no rank prefix) and then the end of the other ranks'. A rank that dies
    takes the others down with it, and their tracebacks would otherwise fill the message and push out its own."""
    lines = stderr.splitlines(keepends=True)
    others = "".join(line for line in lines if line.startswith("[rank") and not line.startswith("[rank0]"))
    own = "".join(line for line in lines if not line.startswith("[rank") or line.startswith("[rank0]"))
    return f"rank 0:\n{own[-keep:]}\nthe other ranks:\n{others[-keep // 3 :]}"
