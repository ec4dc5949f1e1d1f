"""python -m gpumem.torch SCRIPT [ARGS...]: install gpumem as torch's allocator
(options from GPUMEM_CONF), then run SCRIPT as __main__."""

import runpy
import sys

from ._install import install


def main(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    install()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
