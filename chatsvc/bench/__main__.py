"""``python -m chatsvc.bench`` runs the same command as ``chatsvc bench``."""

from __future__ import annotations

import argparse
import sys

from chatsvc.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chatsvc bench", description="Load-test a chat server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
