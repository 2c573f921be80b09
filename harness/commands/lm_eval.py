"""``depthmem lm-eval ARGS...``: lm-eval's own command line, with the ``depthmem`` model and the offline tasks.

lm-eval finds a model class only if its module was imported first, so this imports the adapter (which registers
``depthmem``) and then hands every argument, unchanged, to lm-eval's entry point, e.g.
``depthmem lm-eval run --model depthmem --model_args checkpoint=RUN_DIR --tasks offline_arc_easy``.
When no ``--include_path`` is given, the offline suite's folder is added so its task names resolve.
"""

from __future__ import annotations

import argparse
import logging
import sys

from harness.errors import UsageError

# lm-eval's subcommands that take --include_path; a bare --model or --tasks means its legacy form of `run`.
_TAKES_INCLUDE_PATH = ("run", "ls", "validate")


def add_parser(sub):
    p = sub.add_parser(
        "lm-eval",
        help="lm-eval's own command line with the depthmem model registered",
        description="Run lm-eval's command line (run, ls, validate) with --model depthmem "
        "available and the offline tasks on its include path.",
        add_help=False,
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for lm-eval, unchanged")
    return p


def lm_eval_argv(rest: list[str]) -> list[str]:
    """The arguments handed to lm-eval: the user's, plus the offline suite's folder when none is named."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.evaluation.tasks import TASKS_DIR

    argv = list(rest)
    named = any(a == "--include_path" or a.startswith("--include_path=") for a in argv)
    wants = bool(argv) and (argv[0] in _TAKES_INCLUDE_PATH or any(a in ("--model", "--tasks", "-t") for a in argv))
    if wants and not named:
        argv += ["--include_path", str(TASKS_DIR)]
    # lm-eval records the device it was asked for; on a machine without CUDA the depthmem model runs on the CPU,
    # so ask for that and the record says where it ran.
    if "depthmem" in argv and wants:
        import torch

        if not torch.cuda.is_available():
            at = next((i for i, a in enumerate(argv) if a == "--device" or a.startswith("--device=")), None)
            if at is None:
                argv += ["--device", "cpu"]
            elif argv[at] == "--device" and at + 1 < len(argv) and argv[at + 1].startswith("cuda"):
                argv[at + 1] = "cpu"
            elif argv[at].startswith("--device=cuda"):
                argv[at] = "--device=cpu"
    return argv


def run(args) -> int:
    from harness.evaluation.evaluator import harness_git_hash, prepare_environment

    prepare_environment(offline=False)
    from lm_eval.__main__ import cli_evaluate

    import harness.evaluation.lm_adapter  # noqa: F401  (registers the "depthmem" model with lm-eval)

    # lm-eval's parser reads sys.argv itself, including its legacy form without a subcommand.
    saved = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv(args.rest)]
    logger = logging.getLogger("lm_eval")
    level = logger.level
    try:
        with harness_git_hash():
            cli_evaluate()
    except ValueError as e:
        # lm-eval's own words for a misspelt task name, turned into one sentence without a traceback.
        if not str(e).startswith("Tasks not found"):
            raise
        from harness.evaluation.tasks import KNOWN_NAMES

        missing = str(e).split(":", 1)[-1].strip()
        raise UsageError(
            f"Unknown lm-eval task {missing}; the offline tasks are {', '.join(KNOWN_NAMES)}, and "
            "`depthmem lm-eval ls tasks` lists lm-eval's own."
        ) from None
    finally:
        sys.argv = saved
        _settle_logging(logger, level)
    return 0


class _CurrentStderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is at the time of each record."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _settle_logging(logger: logging.Logger, level: int) -> None:
    """Leave lm-eval's logging as quiet as it was before its command line ran, and safe to outlive ``sys.stderr``.

    lm-eval's entry point attaches, once per process, an INFO handler bound to the ``sys.stderr`` of that moment.
    In a notebook or a test session that stream can be replaced and closed later, and every later lm-eval log
    line would then fail; and left at INFO, a later ``depthmem eval`` in the same process would print lm-eval's
    progress chatter. So the handler follows the current stderr, and the logger's level goes back to what it was
    (the next lm-eval command line raises it again).
    """
    for i, h in enumerate(logger.handlers):
        if type(h) is logging.StreamHandler:
            follower = _CurrentStderr()
            follower.setFormatter(h.formatter)
            follower.setLevel(h.level)
            logger.handlers[i] = follower
    logger.setLevel(level)
