"""The ``depthmem`` command: one subcommand per module in ``harness.commands``, each a thin layer over the API.

Errors a user can fix end with one sentence on standard error and a non-zero exit (2 for bad usage or config);
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import importlib
import os
import sys

from harness import __version__
from harness.commands import lm_eval
from harness.errors import DepthmemError

# Listed by hand so the order of ``--help`` is deliberate and a missing module is an obvious error.
COMMANDS = [
    "variants",
    "train",
    "prepare",
    "sweep",
    "status",
    "cancel",
    "eval",
    "lm_eval",
    "report",
    "compare",
    "pack",
    "bench",
    "selftest",
    "export",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one sentence, exit 2
        self.print_usage(sys.stderr)
        sys.stderr.write(f"depthmem: error: {message}\n")
        raise SystemExit(2)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("depthmem")
    except metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="depthmem", description="Benchmark and ablate depth mixing in transformers.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    parser.add_argument("--version", action="version", version=f"depthmem {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"harness.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"harness.commands.{name}":
                continue
            raise
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def _is_override(arg: str) -> bool:
    key, eq, _ = arg.partition("=")
    return bool(eq) and bool(key) and not arg.startswith("-")


def _take_overrides(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Give a command its KEY=VALUE arguments wherever they stand after it; return what is still unrecognized.

    argparse hands a positional list only the arguments right after the other positionals, so an override after
    an option (``sweep g.yaml --results R eval.tasks=[x]``) arrives here as unrecognized.
    """
    overrides = [a for a in extra if _is_override(a)]
    if not overrides or not hasattr(args, "_parser"):
        return extra
    if not hasattr(args, "overrides"):
        takers = ", ".join(f"depthmem {c}" for c in ("train", "sweep"))
        args._parser.error(
            f"depthmem {args.command} takes no KEY=VALUE overrides, got {overrides[0]!r}; {takers} take them"
        )
    args.overrides = list(args.overrides) + overrides
    return [a for a in extra if not _is_override(a)]


def _stacks_on_crash() -> None:
    """A native crash (a segfault, or an abort inside a library such as a collective's) prints every thread's
    Python stack before the process dies: in a multi-process or SLURM job's log, the lines that say where."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, OSError):
        pass  # a standard error without a file descriptor (captured in a notebook): nowhere to print to


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _stacks_on_crash()
    parser = build_parser()
    # ``lm-eval`` hands everything after it to lm-eval's own command line untouched.
    if argv and argv[0] == "lm-eval":
        args = argparse.Namespace(debug=False, command="lm-eval", rest=argv[1:])

        args._run = lm_eval.run
    else:
        args, extra = parser.parse_known_args(argv)
        extra = _take_overrides(args, extra)
        if extra:  # say it with the usage of the subcommand that got them, not the top-level one
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("DEPTHMEM_DEBUG") == "1"
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except DepthmemError as e:
        if debug:
            raise
        sys.stderr.write(f"depthmem: {e}\n")
        return e.exit_code
    except OSError as e:
        # A file the system refused (no space, no permission, a path through a file): the user's to fix.
        if debug:
            raise
        if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            where = f" writing {str(e.filename)!r}" if e.filename else ""
            sys.stderr.write(
                f"depthmem: no space left on the device{where}; free some space or write elsewhere, "
                "then run the same command again.\n"
            )
            return 1
        if not e.filename:
            raise
        sys.stderr.write(
            f"depthmem: the file system refused {str(e.filename)!r} ({e.strerror or e}); "
            "check that its folder exists and is writable.\n"
        )
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("depthmem: interrupted.\n")
        return 130


PIPE_CLOSED = 141
"""Exit status when the reader of standard output went away (``depthmem status | head``): 128 + SIGPIPE, what a
shell reports for any program a closed pipe stops, so ``set -o pipefail`` scripts see the usual value."""


def _reader_gone() -> int:
    # Nothing more can reach the reader; pointing stdout at /dev/null keeps Python's final flush from printing
    # its own BrokenPipeError message on the way out.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is no real file (captured in-process): nothing will flush it to a pipe
    return PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
