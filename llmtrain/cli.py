"""What every tool in tools/ shares: a user error is one or two lines on one rank; tracebacks on request.

A tool's module imports only argparse at the top and this module, so `--help` answers without importing
torch; its `main(argv)` imports the library inside and returns an exit code. `run_tool(main)` calls it:
- an `llmtrain.errors.UserError` (bad config, data, checkpoint, ...) prints `<tool>: error: <message>` and
  exits with the error's code; under torchrun only rank 0 prints, and a config error only on the first
  launch (torchrun's restarts would repeat it word for word);
- `--debug` on the command line, or LLMTRAIN_DEBUG=1, re-raises instead, with the full traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from llmtrain.launch_env import launch_attempt, launch_rank

DEBUG_ENV = "LLMTRAIN_DEBUG"
DEBUG_FLAG = "--debug"


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Declare --debug so that --help lists it (run_tool reads it from argv before parsing)."""
    parser.add_argument(
        DEBUG_FLAG, action="store_true", help=f"show the full traceback of an error (or set {DEBUG_ENV}=1)"
    )


def add_on_bad_document_flag(parser: argparse.ArgumentParser) -> None:
    """Declare --on-bad-document, shared by the tools that read raw documents (tokenizer training and
    preprocessing treat an unreadable record the same way)."""
    parser.add_argument(
        "--on-bad-document",
        choices=("skip", "error"),
        default="skip",
        help="an unreadable record: skip and count it (default), or stop naming it",
    )


def debug_requested(argv: list[str]) -> bool:
    """Whether the user asked for tracebacks: --debug among the arguments or LLMTRAIN_DEBUG set to non-0."""
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_user_error(err: BaseException, prog: str) -> int:
    """Print a user error once for the whole job; return the exit code this process should use.

    Ranks other than 0 exit 0 after an error every rank sees alike: rank 0's non-zero exit already fails
    the job, and torchrun then names one root cause instead of one failure block per rank.
    """
    rank = launch_rank()
    repeat = launch_attempt() > 0 and getattr(err, "same_on_every_launch", False)
    if rank == 0 and not repeat:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return int(getattr(err, "exit_code", 2)) if rank == 0 else 0


def run_tool(main: Callable[[list[str]], int], argv: list[str] | None = None) -> NoReturn:
    """Run a tool's `main(argv)` and exit with its code, turning user errors into one-line messages."""
    from llmtrain.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    prog = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "llmtrain"
    debug = debug_requested(argv)
    try:
        code = main(argv)
    except UserError as err:
        if debug:
            raise
        code = report_user_error(err, prog)
    sys.exit(code)
