"""python -m gpumem.torch [--debug] SCRIPT [ARGS...]: install gpumem as torch's allocator
(options from GPUMEM_CONF), then run SCRIPT as __main__.

A failure to start (no such script, no torch, no CUDA device, a bad GPUMEM_CONF)
is one line, "gpumem: error: ...", and exit status 2; --debug or GPUMEM_DEBUG=1
shows the traceback instead.  What the script itself raises is the script's own."""

import os
import runpy
import sys

from ..cli.args import _error_line, debug_requested, describe_error

EXIT_USAGE = 2


def main(argv) -> int:
    argv = list(argv)
    debug = False
    if argv and argv[0] == "--debug":
        debug = True
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else EXIT_USAGE
    script = argv[0]
    if not os.path.isfile(script):
        why = "is a directory, not a script" if os.path.isdir(script) else "no such script"
        _error_line(f"{script}: {why}")
        return EXIT_USAGE
    try:
        from ._install import install

        install()
    except Exception as e:
        if debug or debug_requested():
            raise
        _error_line(describe_error(e))
        return EXIT_USAGE
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
