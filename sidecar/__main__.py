"""Command line: `lora-sidecar serve` runs the daemon; the other commands talk to one, or work
on local folders (`validate`, `examples`). Fatal errors become exit codes here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from .config import (
    OPTIONS,
    REGISTRY_START_CHECK_S,
    Settings,
    local_registry_problem,
    option_for,
)
from .errors import CacheOwned, ConfigError
from .exits import EXIT_CACHE_OWNED, EXIT_FAILED, EXIT_USAGE


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    epilog = f"""\
Every option can also be set through the environment variable shown in brackets; flags
override variables, which override defaults. Sizes take bytes or binary units (KiB, MiB, GiB,
TiB); decimal ones (MB, GB) are refused.

Exit code 2, with every problem listed, when the configuration cannot work:
  - an option that does not parse, or options that contradict each other;
  - a local --registry folder that does not exist, is not a folder, or cannot be read;
  - a --pin id the registry answers it has nothing under.
Not a configuration error (the sidecar starts, and /readyz answers 503 saying why until it
passes): an S3 registry that does not answer, refuses the credentials or lacks the bucket; a
cache root that is not writable. When the registry does not answer within
{REGISTRY_START_CHECK_S:g} s at start, the pins are checked when it does: one it then reports
missing keeps /readyz at 503 naming it.
Exit code 1: the sidecar could not bind its port or failed while running; 0 on SIGTERM/SIGINT
(a second SIGTERM/SIGINT while stopping exits at once, with code 1)."""
    parser = subparsers.add_parser(
        "serve",
        help="run the sidecar daemon",
        description="Run the sidecar: stage adapters from the registry into the cache volume "
        "and serve the HTTP API.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    cli.add_sign_command(subparsers)


def _add_examples(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from . import cli

    cli.add_examples_command(subparsers)


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


def _raw_value(args: argparse.Namespace, env: Mapping[str, str], field_name: str) -> str:
    option = option_for(field_name)
    given = getattr(args, field_name, None)
    return str(given if given is not None else env.get(option.env_var, option.default))


def _names(error: ConfigError, field_name: str) -> bool:
    flag = option_for(field_name).flag
    return any(problem.startswith(f"{flag} ") for problem in error.problems)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            settings = settings_from(args, os.environ)
        except ConfigError as exc:
            # The registry folder is judged too, so that one run lists every problem.
            registry = _raw_value(args, os.environ, "registry")
            missing = None if _names(exc, "registry") else local_registry_problem(registry)
            problems = exc.problems + ([missing] if missing else [])
            print(f"lora-sidecar: {ConfigError(problems).message}", file=sys.stderr)
            return EXIT_USAGE
        # The cache's lock first, before the daemon's imports: a second `serve` on an owned
        # cache exits at once, and nothing of the cache is touched before the lock is held.
        from .cache.ownership import CacheLock

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

        try:
            return serve(settings, lock)
        except ConfigError as exc:  # settings that parse but cannot work (sidecar/preflight.py)
            print(f"lora-sidecar: {exc.message}", file=sys.stderr)
            return EXIT_USAGE
    from . import cli

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
