"""What the command line's subcommands share: the argument types (sizes,
whole numbers, the simulated device's capacity), output paths checked before
any work, and the one error line every failure becomes.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from .._units import format_size, has_unit, parse_size

EXIT_OK, EXIT_USAGE = 0, 2


class UsageError(Exception):
    """A mistake in the command line or the input; printed as one line, exit 2."""


# The largest simulated device the command line makes in its default pages:
# the bound every simulated heap keeps to (csrc/include/gpumem/sim.h), as its
# host memory grows with its pages.  An 80 GB GPU is 0.0001 of it.
def _max_sim_capacity() -> int:
    from .. import _C  # the extension is only needed once a heap is made

    return _C.SIM_MAX_PAGES * _C.SIM_PAGE_SIZE


# A traceback instead of the one-line error: `gpumem --debug ...` or this variable.
DEBUG_ENV = "GPUMEM_DEBUG"


def _error_line(message: str) -> None:
    print(f"gpumem: error: {message}", file=sys.stderr, flush=True)


def _usage_failure(message: str) -> int:
    """Say what is wrong as the one error line; the exit status for it."""
    _error_line(message)
    return EXIT_USAGE


def debug_requested(args=None) -> bool:
    """Whether a failure should show its traceback (--debug, or GPUMEM_DEBUG set and not 0)."""
    if getattr(args, "debug", False):
        return True
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe_error(e: BaseException) -> str:
    """An exception as the one line after "gpumem: error: "."""
    if isinstance(e, OSError) and e.strerror:
        name = e.filename if e.filename is not None else ""
        return f"{name}: {e.strerror}" if name != "" else e.strerror
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (ValueError, OSError, ImportError, MemoryError)) or type(e).__module__.startswith("gpumem"):
        return text
    # Not a failure gpumem expects: name it, and say how to see where it came from.
    return f"{type(e).__name__}: {text} (GPUMEM_DEBUG=1 shows the traceback)"


def _size_arg(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    if n >= 1 << 64:
        raise argparse.ArgumentTypeError(f"size does not fit in 64 bits: {text!r}")
    if not has_unit(text):
        raise argparse.ArgumentTypeError(
            f"size {text!r} needs a unit (B, KiB, MiB, GiB, TiB, kB, MB, GB or TB), e.g. '{text.strip()}GiB'"
        )
    return n


def _whole_arg(text: str, what: str, lo: int, hi: Optional[int] = None, hi_text: str = "", unit: str = "") -> int:
    """text as a whole number lo..hi (hi None: no upper bound), or an ArgumentTypeError that names what it is."""
    try:
        n = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a whole number{unit}: {text!r}") from None
    if hi is None and n < lo:
        raise argparse.ArgumentTypeError(f"{what} must be at least {lo}: {text!r}")
    if hi is not None and not lo <= n <= hi:
        raise argparse.ArgumentTypeError(f"{what} must be between {lo} and {hi_text or hi}: {text!r}")
    return n


def _capacity_arg(text: str) -> int:
    """The size of a simulated device: positive, at most _max_sim_capacity()."""
    n = _size_arg(text)
    if n > _max_sim_capacity():
        raise argparse.ArgumentTypeError(
            f"capacity {text!r} is more than the simulated device holds ({format_size(_max_sim_capacity())})"
        )
    return n


def _check_output_path(option: str, path: str, usage_error) -> None:
    """Refuse an output file that cannot be written before any work is done."""
    if os.path.isdir(path):
        raise usage_error(f"{option} {path}: is a directory, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise usage_error(f"{option} {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK):
        raise usage_error(f"{option} {path}: folder {folder} is not writable")


def replay_heap_kwargs(args) -> Optional[dict]:
    """The heap options --chunk-pages, --page-size and --pressure ask for (None: gpumem's defaults)."""
    kw = {}
    if getattr(args, "pressure", None) is not None:
        kw["pressure"] = args.pressure
    if getattr(args, "chunk_pages", None):
        kw["chunk_pages"] = args.chunk_pages
    if getattr(args, "page_size", None):
        kw["page_size"] = args.page_size
    return kw or None


# ---- arguments more than one subcommand takes ------------------------------------------


def add_traces_arg(p: argparse.ArgumentParser, help: str) -> None:
    """The TRACE... positional arguments."""
    p.add_argument("traces", nargs="+", metavar="TRACE", help=help)


def add_capacity_arg(p, option: str, help: str, default: Optional[int] = None) -> None:
    """A size option (--capacity, --cap, ...) of at most the simulated device's capacity."""
    p.add_argument(option, type=_capacity_arg, default=default, metavar="SIZE", help=help)


def add_device_arg(p: argparse.ArgumentParser, help: str) -> None:
    """--device N: which device of a torch snapshot."""
    p.add_argument("--device", type=int, default=None, metavar="N", help=help)
