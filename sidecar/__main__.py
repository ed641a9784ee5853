"""Command line: `lora-sidecar serve` runs the daemon; the other commands talk to one, or work
on local folders (`validate`, `examples`). Fatal errors become exit codes here and nowhere else.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Mapping, Sequence

from .config import OPTIONS, Settings, option_for
from .core.errors import CacheOwned, ConfigError
from .core.exits import EXIT_CACHE_OWNED, EXIT_FAILED, EXIT_USAGE
from .core.options import Option
from .core.version import version
from .process.preflight import START_CHECK_S, registry_folder_problem

# `serve --help` in sections, by what each option is about; every option of config.OPTIONS is
# in one (an option left out would land in a last section, "other options").
SERVE_SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the registry, where adapters come from", (
        "registry", "s3_endpoint_url", "s3_region", "s3_connect_timeout_s",
        "s3_read_timeout_s", "s3_max_attempts", "part_size_bytes", "download_concurrency")),
    ("the cache volume shared with Triton, its budget and leases", (
        "cache_root", "triton_cache_root", "max_bytes", "max_adapters", "eviction_policy",
        "min_free_bytes", "pin", "lease_ttl_s", "max_leases", "stage_timeout_s",
        "refusal_ttl_s", "not_found_ttl_s", "upload_settle_s")),
    ("validation, what the engine can serve", (
        "engine_config", "max_lora_rank", "allowed_target_modules", "base_model",
        "base_model_config", "signing_policy")),
    ("the catalog of names vLLM knows, and Triton's reloads", (
        "catalog_refresh_s", "spare_names", "spare_names_max", "compact_below",
        "compaction_window", "triton_url",
        "triton_model", "triton_reload", "triton_probe_timeout_s",
        "triton_reload_min_interval_s", "seed_model_repository")),
    ("the HTTP API", ("host", "port", "api_token", "api_token_file", "tenants_file",
                      "max_request_bytes")),
    ("metrics and logs", (
        "metrics_host", "metrics_port", "epp_metrics", "epp_adapter_prefix",
        "epp_label_max_bytes", "log_level", "log_format")),
)


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    epilog = f"""\
Every option can also be set through the environment variable shown in brackets; flags
override variables, which override defaults. Sizes take bytes or binary units (KiB, MiB, GiB,
TiB); decimal ones (MB, GB) are refused.

Exit codes:
  0  stopped by SIGTERM or SIGINT.
  1  the port could not be bound (the message names the option to change), or the sidecar
     failed while running; also a second SIGTERM/SIGINT while stopping (it exits at once).
  2  the configuration cannot work; every problem is listed, nothing is created:
     - an option that does not parse, or options that contradict each other;
     - a local --registry folder that does not exist, is not a folder, or cannot be read;
     - a --pin id the registry answers it has nothing under.
  3  another lora-sidecar owns the cache root (the message names it: pid, host, port);
     nothing was changed.
Not a configuration error (the sidecar starts, and /readyz answers 503 saying why until it
passes): an S3 registry that does not answer, refuses the credentials or lacks the bucket; a
cache root that is not writable. When the registry does not answer within
{START_CHECK_S:g} s at start, the pins are checked when it does: one it then reports
missing keeps /readyz at 503 naming it."""
    parser = subparsers.add_parser(
        "serve",
        help="run the sidecar daemon",
        description="Run the sidecar: stage adapters from the registry into the cache volume "
        "and serve the HTTP API.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        usage="%(prog)s [OPTION VALUE]...",  # the sections below list them
    )
    sectioned = {name for _, names in SERVE_SECTIONS for name in names}
    others = tuple(o.field for o in OPTIONS if o.field not in sectioned)
    for title, names in (*SERVE_SECTIONS, *((("other options", others),) if others else ())):
        group = parser.add_argument_group(title)
        for name in names:
            _add_option(group, option_for(name))


def _add_option(group: argparse._ArgumentGroup, option: Option) -> None:
    """One option; its default is stated once, in the brackets with its variable."""
    default = option.default_text or option.default or "unset"
    group.add_argument(option.flag, dest=option.field, metavar=option.metavar, default=None,
                       help=f"{option.help} [{option.env_var}; default: {default}]")


def _add_client_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .process import cli

    cli.add_commands(subparsers)


def _add_validate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .process import cli

    cli.add_validate_command(subparsers)
    cli.add_sign_command(subparsers)


def _add_examples(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .process import cli

    cli.add_examples_command(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-sidecar",
        description="Stage LoRA adapters from S3 onto a GPU node's disk for Triton + vLLM.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"lora-sidecar {version()}")
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


def parse_command_line(parser: argparse.ArgumentParser,
                       argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is refused by its command's own parser (its usage,
    not the top level's), with the nearest option it has as a suggestion."""
    args, unknown = parser.parse_known_args(argv)
    if not unknown:
        return args
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command: argparse.ArgumentParser = commands.choices[args.command]
    known = [flag for action in command._actions for flag in action.option_strings]
    hint = ""
    first = next((u for u in unknown if u.startswith("-")), None)
    if first is not None:
        close = difflib.get_close_matches(first.partition("=")[0], known, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {close[0]}?"
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(build_parser(), argv)
    if args.command == "serve":
        try:
            settings = settings_from(args, os.environ)
        except ConfigError as exc:
            # The registry folder is judged too, so that one run lists every problem.
            registry = _raw_value(args, os.environ, "registry")
            missing = None if _names(exc, "registry") else registry_folder_problem(registry)
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
        from .process.app import serve

        try:
            return serve(settings, lock)
        except ConfigError as exc:  # settings that parse but cannot work (process/preflight.py)
            print(f"lora-sidecar: {exc.message}", file=sys.stderr)
            return EXIT_USAGE
    from .process import cli

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
