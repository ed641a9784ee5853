"""Client commands (`stage`, `evict`, `ls`, `pin`, `unpin`, `prewarm`) that talk to a running
sidecar over HTTP, `validate`, which checks a local folder with the sidecar's rules, `sign`,
which signs one for a signing policy, and `examples`, which fills an empty local registry.

The sidecar's error messages speak its HTTP API (`"force": true`, its own `--api-token`); where
the command line has its own way to do the thing, the message printed here names that instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Settings
from ..core.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ..core.ids import is_valid_adapter_id
from ..core.options import Option, options_of
from ..core.units import format_size
from ..validation.options import ValidationOptions, take_engine_limits

_SERVED = {declared.field: declared.default for declared in options_of(Settings)}
DEFAULT_URL = f"http://{_SERVED['host']}:{_SERVED['port']}"  # where `serve` listens by default
Handler = Callable[[argparse.Namespace], int]


class ClientError(Exception):
    """The sidecar answered with an error, or could not be reached."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message", "error"))
        self.status = status
        self.body = body


def _request(args: argparse.Namespace, method: str, path: str,
             body: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    token = _token(args)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            parsed: dict[str, Any] = json.loads(response.read() or b"{}")
            return parsed
    except urllib.error.HTTPError as exc:
        try:
            payload = json.loads(exc.read() or b"{}")
        except ValueError:
            payload = {}
        if not isinstance(payload, dict):
            payload = {}
        payload.setdefault("error", f"http_{exc.code}")
        payload.setdefault("message", exc.reason)
        raise ClientError(exc.code, payload) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ClientError(0, {"error": "unreachable",
                              "message": f"cannot reach the sidecar at {args.url}: {reason} "
                              "(is `lora-sidecar serve` running there? --url or "
                              "LORA_SIDECAR_URL name another address)"}
                          ) from None


def _print(args: argparse.Namespace, payload: Any, text: str) -> None:
    print(json.dumps(payload, indent=2) if args.json else text)


def _fail(args: argparse.Namespace, error: ClientError) -> int:
    if args.json:
        print(json.dumps(error.body, indent=2))
    else:
        print(f"error: {error.body.get('error')}: {_message(args, error.body)}", file=sys.stderr)
        _print_problems(error.body)
    return EXIT_FAILED


def _print_problems(body: dict[str, Any]) -> None:
    """A refusal's problems, one line each (the message above them does not repeat them)."""
    for problem in body.get("problems", []) or []:
        if isinstance(problem, dict):
            print(f"  - {problem.get('code')} {problem.get('file')}: "
                  f"{problem.get('message')}", file=sys.stderr)


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get("LORA_SIDECAR_API_TOKEN") or None


def _message(args: argparse.Namespace, body: dict[str, Any]) -> str:
    """The sidecar's message, or for the errors a flag of this command line answers, one that
    names the flag."""
    code, message = body.get("error"), str(body.get("message"))
    if code == "adapter_in_use" and args.command == "evict":
        why, undo = [], []
        if body.get("pinned"):
            why.append("pinned")
            undo.append("unpins it")
        if body.get("leases"):
            why.append(f"held by {body['leases']} live lease(s)")
            undo.append("ends the leases")
        what = " and ".join(why) or "in use"
        consequence = f" ({' and '.join(undo)})" if undo else ""
        return (f"adapter {args.adapter_id} is {what}; `lora-sidecar evict {args.adapter_id} "
                f"--force` evicts it anyway{consequence}")
    if code == "unauthorized":
        if _token(args) is None:
            return (f"the sidecar at {args.url} needs its API token for `{args.command}`: pass "
                    "--token TOKEN or set LORA_SIDECAR_API_TOKEN (the token the sidecar was "
                    "started with)")
        return (f"the sidecar at {args.url} refused the token given (--token or "
                "LORA_SIDECAR_API_TOKEN): pass the token the sidecar was started with")
    if code == "stage_timeout":
        return f"{message} (--timeout sets how long this command waits)"
    if code == "invalid_adapter" and body.get("problems"):
        return _refusal(args, body)
    return message


def _refusal(args: argparse.Namespace, body: dict[str, Any]) -> str:
    """The head of a refusal; the API's message also quotes the first problems, which the
    command line lists in full below it."""
    adapter_id = body.get("adapter_id") or getattr(args, "adapter_id", "")
    count = len(body["problems"])
    head = f"adapter {adapter_id} was refused by validation ({count} problem" + (
        "s)" if count > 1 else ")")
    until = body.get("remembered_until")
    if body.get("remembered"):
        head += f", at {body.get('refused_at')}: this is that remembered verdict"
    if until:
        head += (f"; the verdict is kept until {until} (--refusal-ttl): after fixing the "
                 f"adapter, `lora-sidecar evict {adapter_id}` clears it now")
    return head


def _check_ids(ids: list[str]) -> None:
    bad = [i for i in ids if not is_valid_adapter_id(i)]
    if bad:
        print(f"error: invalid adapter id(s): {', '.join(map(repr, bad))}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


# ---- commands ------------------------------------------------------------------------------


def cmd_stage(args: argparse.Namespace) -> int:
    _check_ids([args.adapter_id])
    try:
        answer = _request(args, "POST", "/stage",
                          {"adapter_id": args.adapter_id, "timeout_s": args.timeout,
                           "lease": False}, timeout_s=args.timeout + 5)
    except ClientError as exc:
        return _fail(args, exc)
    state = "cached" if answer.get("cached") else "staged"
    _print(args, answer, f"{state} {answer['adapter_id']} ({format_size(answer['size_bytes'])}) "
           f"at {answer['path']}")
    return EXIT_OK


def cmd_evict(args: argparse.Namespace) -> int:
    _check_ids([args.adapter_id])
    try:
        answer = _request(args, "POST", "/evict",
                          {"adapter_id": args.adapter_id, "force": args.force})
    except ClientError as exc:
        return _fail(args, exc)
    if answer.get("reason") == "forgotten":  # not cached: only a remembered refusal
        _print(args, answer, f"forgot the remembered refusal of {args.adapter_id}: the next "
               "stage fetches and validates it again")
        return EXIT_OK
    broken = answer.get("broken_leases") or []
    extra = f", broke {len(broken)} lease(s)" if broken else ""
    if answer.get("forgot_refusal"):
        extra += ", forgot its remembered refusal"
    _print(args, answer, f"evicted {args.adapter_id}, freed "
           f"{format_size(answer['freed_bytes'])}{extra}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    try:
        answer = _request(args, "GET", "/adapters")
    except ClientError as exc:
        return _fail(args, exc)
    if args.json:
        print(json.dumps(answer, indent=2))
        return EXIT_OK
    rows = [("ADAPTER", "SIZE", "PINNED", "LEASES", "LAST USED")]
    for a in answer["adapters"]:
        rows.append((a["adapter_id"], format_size(a["size_bytes"]), "yes" if a["pinned"] else "",
                     str(a["leases"]), a["last_used"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    cache = answer["cache"]
    print(f"\n{cache['adapters']}/{cache['max_adapters']} adapters, "
          f"{format_size(cache['bytes'])} of {format_size(cache['max_bytes'])}")
    return EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    _check_ids([args.adapter_id])
    path = "/pin" if args.command == "pin" else "/unpin"
    body: dict[str, Any] = {"adapter_id": args.adapter_id}
    if args.command == "pin":
        body["timeout_s"] = args.timeout
    try:
        answer = _request(args, "POST", path, body, timeout_s=args.timeout + 5)
    except ClientError as exc:
        return _fail(args, exc)
    if args.command == "unpin" and not answer.get("was_pinned"):
        text = f"{args.adapter_id} was not pinned; nothing changed"
    elif args.command == "unpin":
        text = f"unpinned {args.adapter_id}"
    else:
        text = (f"pinned {args.adapter_id} ({format_size(answer['size_bytes'])}) "
                f"at {answer['path']}")
    _print(args, answer, text)
    return EXIT_OK


def cmd_prewarm(args: argparse.Namespace) -> int:
    """Stage every id, then wait for readiness; exit 0 only if all of it worked."""
    _check_ids(args.adapter_ids)
    failed: list[str] = []
    results: dict[str, Any] = {}
    for adapter_id in args.adapter_ids:
        try:
            answer = _request(args, "POST", "/stage",
                              {"adapter_id": adapter_id, "timeout_s": args.timeout,
                               "lease": False}, timeout_s=args.timeout + 5)
        except ClientError as exc:
            failed.append(adapter_id)
            results[adapter_id] = exc.body
            if not args.json:
                print(f"FAILED {adapter_id}: {exc.body.get('error')}: "
                      f"{_message(args, exc.body)}", file=sys.stderr)
                _print_problems(exc.body)
            continue
        results[adapter_id] = answer
        if not args.json:
            state = "cached" if answer.get("cached") else "staged"
            print(f"{state:6} {adapter_id} ({format_size(answer['size_bytes'])})")
    ready, reason = _wait_ready(args)
    if args.json:
        print(json.dumps({"results": results, "failed": failed, "ready": ready,
                          "reason": reason}, indent=2))
    elif not ready:
        print(f"sidecar not ready: {reason}", file=sys.stderr)
    else:
        print(f"ready: {len(args.adapter_ids) - len(failed)}/{len(args.adapter_ids)} staged")
    return EXIT_OK if ready and not failed else EXIT_FAILED


def _wait_ready(args: argparse.Namespace) -> tuple[bool, str]:
    deadline = time.monotonic() + args.ready_timeout
    reason = "no answer"
    while True:
        try:
            _request(args, "GET", "/readyz", timeout_s=5)
            return True, ""
        except ClientError as exc:
            reason = str(exc.body.get("message"))
        if time.monotonic() >= deadline:
            return False, reason
        time.sleep(0.5)


def cmd_validate(args: argparse.Namespace) -> int:
    from ..validation.shapes import ModelShapes
    from ..validation.signing_policy import NO_POLICY, SigningPolicy
    from ..validation.validate import Rules, run_validate

    values: dict[str, Any] = {}
    for declared in _validate_options():
        raw = getattr(args, declared.field)
        if raw is None:
            raw = os.environ.get(declared.env_var, declared.default)
        try:
            values[declared.field] = declared.parse(raw)
        except (ValueError, TypeError) as exc:
            print(f"error: {declared.flag} ({declared.env_var}) = {raw!r}: {exc}",
                  file=sys.stderr)
            return EXIT_USAGE
    given = {o.field for o in _validate_options()
             if getattr(args, o.field) is not None or o.env_var in os.environ}
    problems = take_engine_limits(values, given)
    if problems:
        print("error: " + "\n".join(problems), file=sys.stderr)
        return EXIT_USAGE
    try:
        shapes = (ModelShapes.from_file(values["base_model_config"])
                  if values["base_model_config"] else None)
    except (OSError, ValueError) as exc:
        print(f"error: --base-model-config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        signing = SigningPolicy.load(args.policy) if args.policy else NO_POLICY
    except ValueError as exc:
        print(f"error: --policy {args.policy}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    rules = Rules(max_lora_rank=values["max_lora_rank"],
                  allowed_target_modules=frozenset(values["allowed_target_modules"]),
                  base_model=values["base_model"], shapes=shapes, signing=signing)
    if not args.path.is_dir():
        print(f"error: {args.path} is not a folder", file=sys.stderr)
        return EXIT_USAGE
    return run_validate(args.path, rules, as_json=args.json, out=sys.stdout,
                        adapter_id=args.adapter_id)


def cmd_sign(args: argparse.Namespace) -> int:
    """Sign an adapter folder in OMS format (model.sig) so that a sidecar whose policy names
    this key (or the certificate's CA and identity) accepts it."""
    from ..cache.records import content_digest
    from ..core.filehash import hash_file
    from ..validation.files import SIGNATURE_FILE, listed, plan_folder
    from ..validation.signing_policy import signing_extra_missing

    missing = signing_extra_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_USAGE
    from ..validation.oms import sign_folder

    folder: Path = args.folder
    if not folder.is_dir():
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return EXIT_USAGE
    if bool(args.certificate) != bool(args.chain):
        print("error: --certificate and --chain go together (the signing certificate and the "
              "CA certificates it chains up to)", file=sys.stderr)
        return EXIT_USAGE
    # The statement lists what the sidecar publishes; an entry that makes it refuse the
    # adapter would be refused whatever the signature says.
    plan = plan_folder(folder)
    if plan.problems:
        print(f"error: the sidecar would refuse {folder}; fix it first:\n  "
              + "\n  ".join(f"{p.code} {p.file}: {p.message}" for p in plan.problems),
              file=sys.stderr)
        return EXIT_FAILED
    if plan.ignored:
        print(f"note: left out, as the sidecar leaves them out: {listed(plan.ignored)}")
    password = None
    if args.key_password_file:
        password = args.key_password_file.read_text(encoding="utf-8").strip()
    try:
        signature = sign_folder(folder, private_key=args.key, certificate=args.certificate,
                                chain=args.chain or (), password=password)
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: cannot sign {folder}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    sums = {name: hash_file(folder / name).sha256 for name in plan.fetched
            if name != SIGNATURE_FILE}
    print(f"signed {len(sums)} files of {folder} into {signature}\n"
          f"content digest {content_digest(sums)} (the sidecar answers it for these bytes)")
    return EXIT_OK


def cmd_examples(args: argparse.Namespace) -> int:
    """Write the example adapters into an empty or new folder; say what was done either way."""
    from .examples import EXAMPLE_ADAPTERS, ensure_examples

    folder: Path = args.folder
    try:
        present = sorted(entry.name for entry in folder.iterdir()) if folder.exists() else []
        if present and set(EXAMPLE_ADAPTERS) <= set(present):
            print(f"the example adapters {', '.join(EXAMPLE_ADAPTERS)} are already in {folder}")
            return EXIT_OK
        if present:
            shown = ", ".join(map(repr, present[:5])) + (" …" if len(present) > 5 else "")
            print(f"{folder} is not empty ({len(present)} entries: {shown}): no example was "
                  "written; examples go into an empty or new folder only",
                  file=sys.stdout if args.skip_if_not_empty else sys.stderr)
            return EXIT_OK if args.skip_if_not_empty else EXIT_FAILED
        written = ensure_examples(folder)
    except OSError as exc:
        print(f"error: cannot write the examples into {folder}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote example adapters {', '.join(written)} into {folder}")
    return EXIT_OK


# ---- argument parsing ----------------------------------------------------------------------


def _client_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                   help_text: str, handler: Handler) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                   allow_abbrev=False)
    parser.add_argument("--url", default=os.environ.get("LORA_SIDECAR_URL", DEFAULT_URL),
                        help=f"the sidecar's address [LORA_SIDECAR_URL; default {DEFAULT_URL}]")
    parser.add_argument("--token", default=None,
                        help="bearer token for mutating calls [LORA_SIDECAR_API_TOKEN]")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(handler=handler)
    return parser


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _client_parser(subparsers, "stage", "stage an adapter (download it if needed)", cmd_stage)
    p.add_argument("adapter_id")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    p = _client_parser(subparsers, "evict", "remove an adapter from the cache, and forget a "
                       "remembered refusal of it (after fixing it in the registry)", cmd_evict)
    p.add_argument("adapter_id")
    p.add_argument("--force", action="store_true",
                   help="evict even if pinned or leased (breaks the leases)")
    _client_parser(subparsers, "ls", "list cached adapters", cmd_ls)
    for name, text in (("pin", "stage an adapter and keep it from eviction"),
                       ("unpin", "let a pinned adapter be evicted again")):
        p = _client_parser(subparsers, name, text, cmd_pin)
        p.add_argument("adapter_id")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    p = _client_parser(subparsers, "prewarm",
                       "stage a list of adapters and wait until the sidecar is ready; exit 0 only "
                       "when every adapter is staged", cmd_prewarm)
    p.add_argument("adapter_ids", nargs="+", metavar="ADAPTER_ID")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait per adapter")
    p.add_argument("--ready-timeout", type=float, default=60.0,
                   help="seconds to wait for /readyz after staging (default 60)")


def _validate_options() -> tuple[Option, ...]:
    """The rules `validate` shares with `serve`: the same flags, parsers and defaults, and the
    same LORA_SIDECAR_* variables, so a folder is judged as the sidecar started in that
    environment would judge it (the signing policy is `--policy` here)."""
    shared = ("engine_config", "max_lora_rank", "allowed_target_modules", "base_model",
              "base_model_config")
    return tuple(o for o in options_of(ValidationOptions) if o.field in shared)


def add_validate_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "validate", allow_abbrev=False,
        help="check a local adapter folder with the sidecar's rules",
        description="Check a local adapter folder with the same rules the sidecar applies "
        "before publishing; exit 0 if valid, 1 with every problem listed if not.",
    )
    p.add_argument("path", type=Path)
    for declared in _validate_options():
        shown = declared.default_text or declared.default or "unset"
        p.add_argument(declared.flag, dest=declared.field, default=None,
                       metavar=declared.metavar,
                       help=f"{declared.help} (default: ${declared.env_var}, "
                       f"else {shown})")
    p.add_argument("--policy", type=Path, default=None,
                   help="a signing policy (the sidecar's --signing-policy): check the folder's "
                   "OMS signature (model.sig) as a stage of ADAPTER_ID would")
    p.add_argument("--adapter-id", default=None,
                   help="the id the policy's rules are matched against (default: the folder's "
                   "name)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(handler=cmd_validate)


def add_sign_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sign", help="sign an adapter folder (OMS, model.sig) for a sidecar's signing policy",
        description="Write FOLDER/model.sig: an OpenSSF Model Signing (OMS v1.0) signature of "
        "every file of the folder (SHA-256 of each whole file), with an elliptic-curve key "
        "(P-256, P-384 or P-521), or with a certificate issued to that key. Upload model.sig "
        "with the adapter; a sidecar whose --signing-policy names the public key (or the CA "
        "and the certificate's identity) for the adapter's id then serves it.",
    )
    p.add_argument("folder", type=Path, help="the adapter folder (named as its adapter id)")
    p.add_argument("--key", type=Path, required=True, help="the private key, PEM")
    p.add_argument("--key-password-file", type=Path, default=None,
                   help="a file holding the private key's password, if it is encrypted")
    p.add_argument("--certificate", type=Path, default=None,
                   help="sign with this certificate (PEM) of the key, instead of the bare key")
    p.add_argument("--chain", type=Path, action="append", default=None,
                   help="a CA certificate the --certificate chains up to (repeat it, issuer "
                   "first)")
    p.set_defaults(handler=cmd_sign)


def add_examples_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "examples", allow_abbrev=False,
        help="write two small example adapters into an empty local registry",
        description="Write two small, valid example adapters (example-support-v1, "
        "example-sql-v1) into FOLDER if it is empty or does not exist. Exit 0 when they were "
        "written or are there already; 1 when FOLDER holds something else (nothing is "
        "written), unless --skip-if-not-empty.",
    )
    p.add_argument("folder", type=Path, nargs="?", default=Path("./registry"),
                   help="the local registry to fill (default ./registry)")
    p.add_argument("--skip-if-not-empty", action="store_true",
                   help="a folder that holds other things is left alone with exit 0 (what "
                   "`make run` does, so that your own adapters in ./registry are served)")
    p.set_defaults(handler=cmd_examples)


def run(args: argparse.Namespace) -> int:
    handler: Handler = args.handler
    return handler(args)
