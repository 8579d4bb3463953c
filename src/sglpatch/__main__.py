"""``python -m sglpatch`` and the ``sglpatch`` console script: the command line of sglpatch.cli, and
one line instead of a traceback when this interpreter lacks one of the tool's dependencies."""

import sys


def run() -> int:
    try:
        from sglpatch.cli import main
    except ModuleNotFoundError as e:
        from sglpatch import exitcodes

        checkout = __file__.rsplit("/src/sglpatch/", 1)[0] if "/src/sglpatch/" in __file__ else "the sglpatch checkout"
        dist = {"git": "GitPython"}.get(e.name or "", e.name)
        print(
            f"sglpatch: error: {sys.executable} lacks {dist!r}, which the tool needs; run the tool through "
            f"{checkout}/scripts/*.sh: they set up its own venv on first use",
            file=sys.stderr,
        )
        return exitcodes.CANNOT_RUN
    return main()


if __name__ == "__main__":
    sys.exit(run())
