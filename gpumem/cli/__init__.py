"""Command line: python -m gpumem SUBCOMMAND ...

Subcommands register themselves in COMMANDS (name -> (help, add_arguments, run)),
so a new one is a function pair, not a change to the dispatcher.  Every failure
is one line on stderr, "gpumem: error: ...", and exit status 2: main() turns any
exception a subcommand raises into that line, so a subcommand only raises
(UsageError, TraceError, ValueError, OSError, ...).  `gpumem --debug ...` or
GPUMEM_DEBUG=1 shows the traceback instead.

The subcommands: replay (gpumem/cli/replay.py), explain (explain.py), forecast
(forecast.py); what they share, argument types and the error line, is in args.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

from .. import __version__
from . import explain, forecast, replay
from .args import EXIT_OK, UsageError, _usage_failure, debug_requested, describe_error


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus an error; gpumem prints one line and exits 2."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


COMMANDS: Dict[str, Tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "replay": ("replay allocation traces on a simulated device", replay.add_replay_args, replay.run_replay),
    "explain": (
        "would gpumem have fitted a torch snapshot that ran out of memory (or at --capacity)?",
        explain.add_explain_args,
        explain.run_explain,
    ),
    "forecast": (forecast.HELP, forecast.add_forecast_args, forecast.run_forecast),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpumem", description="gpumem: a defragmenting GPU memory allocator.")
    parser.add_argument("--version", action="version", version=f"gpumem {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (as does GPUMEM_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        # also after the subcommand; SUPPRESS keeps an absent one from undoing `gpumem --debug`
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
        )
        p.set_defaults(_run=run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        return args._run(args)
    except UsageError as e:
        return _usage_failure(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `gpumem replay ... | head`: stop quietly, and keep Python from
        # complaining again while flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as e:
        # Anything else (a bad file, an unwritable output, a broken extension,
        # a bug): one line, unless a traceback was asked for.
        if debug_requested(args):
            raise
        return _usage_failure(describe_error(e))
