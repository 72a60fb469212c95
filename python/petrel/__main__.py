"""``python -m petrel``: the package's version, and a look into a log directory."""

from __future__ import annotations

import argparse
import sys

import petrel


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m petrel", description=petrel.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"petrel {petrel.__version__}")
    commands = parser.add_subparsers(dest="command")
    dump = commands.add_parser("dump", help="print a log's records, one per line")
    dump.add_argument("path", help="the log's directory")
    dump.add_argument("--from", dest="start", type=int, default=None, help="first offset (default: the oldest)")
    dump.add_argument("--count", type=int, default=None, help="at most this many records")
    info = commands.add_parser("info", help="a log's first and next offsets")
    info.add_argument("path", help="the log's directory")
    args = parser.parse_args(argv)
    if args.command is None:
        print(f"petrel {petrel.__version__}: try `python -m petrel --help`")
        return 0
    try:
        with petrel.Log(args.path) as log:
            if args.command == "info":
                print(f"first_offset {log.first_offset}\nnext_offset {log.next_offset}")
                return 0
            for n, record in enumerate(log.reader(args.start)):
                if args.count is not None and n >= args.count:
                    break
                print(f"{record.offset}\t{record.timestamp}\t{record.payload!r}")
    except petrel.PetrelError as e:
        print(f"petrel: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
