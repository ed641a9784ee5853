"""Command line: `lora-sidecar serve` runs the daemon; the other commands talk to one, or work
on local folders (`validate`, `examples`). Fatal errors become exit codes here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .config import OPTIONS, Settings
from .errors import CacheOwned, ConfigError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
DEFAULT_URL = "http://127.0.0.1:8500"


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    epilog = "Every option can also be set through the environment variable shown in brackets."
    parser = subparsers.add_parser(
        "serve",
        help="run the sidecar daemon",
        description="Run the sidecar: stage adapters from the registry into the cache volume "
        "and serve the HTTP API.",
        epilog=epilog,
    )
    for option in OPTIONS:
        parser.add_argument(
            option.flag,
            dest=option.field,
            metavar=option.metavar,
            default=None,
            help=f"{option.help} [{option.env_var}; default: {option.default or 'unset'}]",
        )


def _add_client_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from . import cli

    cli.add_commands(subparsers)


def _add_validate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from . import cli

    cli.add_validate_command(subparsers)


def _add_examples(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "examples",
        help="write two small example adapters into an empty local registry",
        description="Write two small, valid example adapters into FOLDER if it is empty "
        "(or does not exist); leave it alone otherwise.",
    )
    parser.add_argument("folder", type=Path, nargs="?", default=Path("./registry"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-sidecar",
        description="Stage LoRA adapters from S3 onto a GPU node's disk for Triton + vLLM.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(subparsers)
    _add_client_commands(subparsers)
    _add_validate(subparsers)
    _add_examples(subparsers)
    return parser


def settings_from(args: argparse.Namespace, env: Mapping[str, str]) -> Settings:
    """Command-line flags override environment variables, which override defaults."""
    values = {o.field: env[o.env_var] for o in OPTIONS if o.env_var in env}
    for option in OPTIONS:
        given = getattr(args, option.field, None)
        if given is not None:
            values[option.field] = given
    return Settings.from_values(values)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            settings = settings_from(args, os.environ)
        except ConfigError as exc:
            print(f"lora-sidecar: {exc.message}", file=sys.stderr)
            return EXIT_USAGE
        # The cache's lock first, before the daemon's imports: a second `serve` on an owned
        # cache exits at once, and nothing of the cache is touched before the lock is held.
        from .ownership import EXIT_CACHE_OWNED, CacheLock

        lock = CacheLock(settings.cache_root)
        try:
            lock.acquire(settings.port or None)
        except CacheOwned as exc:
            print(f"lora-sidecar: cannot start: {exc.message}", file=sys.stderr)
            return EXIT_CACHE_OWNED
        except OSError as exc:
            print(f"lora-sidecar: cannot start: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_FAILED
        from .app import serve

        return serve(settings, lock)
    if args.command == "examples":
        from .examples import ensure_examples

        written = ensure_examples(args.folder)
        if written:
            print(f"wrote example adapters {', '.join(written)} into {args.folder}")
        return EXIT_OK
    from . import cli

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
