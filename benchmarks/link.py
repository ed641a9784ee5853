"""The shaped link: the server in its own network namespace, joined to the clients' (the root
namespace) by a veth pair, its sending side limited per TCP connection with HTB.

This kernel has HTB and the u32 classifier but no netem, fq or flow classifier, so each
connection is steered into one of 256 HTB classes by a u32 hash of the client's port; the
20 ms before each response is added by the server itself (benchmarks/s3rver.js --delay-ms).
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass

NAMESPACE = "lsbench-s3"
CLIENT_IF, SERVER_IF = "lsb-client", "lsb-server"
CLIENT_ADDR, SERVER_ADDR = "10.203.0.1", "10.203.0.2"
BUCKETS = 256  # u32's largest hash table


@dataclass(frozen=True, slots=True)
class ShapedLink:
    namespace: str
    server_addr: str
    per_connection_mbit: int


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc_batch(per_connection_mbit: int) -> str:
    """HTB classes 1:100..1:1ff, one per hash bucket; everything that is not TCP goes to 1:2."""
    lines = [
        f"qdisc add dev {SERVER_IF} root handle 1: htb default 2",
        f"class add dev {SERVER_IF} parent 1: classid 1:1 htb rate 100gbit quantum 65536",
        f"class add dev {SERVER_IF} parent 1:1 classid 1:2 htb rate 100gbit quantum 65536",
    ]
    for bucket in range(BUCKETS):
        lines.append(
            f"class add dev {SERVER_IF} parent 1:1 classid 1:{0x100 + bucket:x} htb "
            f"rate {per_connection_mbit}mbit ceil {per_connection_mbit}mbit quantum 65536"
        )
    lines.append(f"filter add dev {SERVER_IF} parent 1: prio 1 handle 2: protocol ip u32 divisor "
                 f"{BUCKETS}")
    for bucket in range(BUCKETS):
        lines.append(
            f"filter add dev {SERVER_IF} parent 1: prio 1 protocol ip u32 ht 2:{bucket:x}: "
            f"match u32 0 0 flowid 1:{0x100 + bucket:x}"
        )
    # The server's packets carry the client's port as TCP destination port (bytes 22-23 of an
    # option-free IPv4 header). Linux hands out ephemeral ports in steps of two, so bits 1-8
    # are hashed: consecutive connections land in different classes.
    lines.append(
        f"filter add dev {SERVER_IF} parent 1: prio 1 protocol ip u32 ht 800:: "
        "match ip protocol 6 0xff hashkey mask 0x000001fe at 20 link 2:"
    )
    return "\n".join(lines) + "\n"


def set_up(per_connection_mbit: int) -> ShapedLink:
    tear_down()
    _ip("netns", "add", NAMESPACE)
    try:
        _ip("link", "add", CLIENT_IF, "type", "veth", "peer", "name", SERVER_IF,
            "netns", NAMESPACE)
        _ip("addr", "add", f"{CLIENT_ADDR}/30", "dev", CLIENT_IF)
        _ip("link", "set", CLIENT_IF, "up")
        _ip("-n", NAMESPACE, "addr", "add", f"{SERVER_ADDR}/30", "dev", SERVER_IF)
        _ip("-n", NAMESPACE, "link", "set", SERVER_IF, "up")
        _ip("-n", NAMESPACE, "link", "set", "lo", "up")
        with tempfile.NamedTemporaryFile("w", suffix=".tc") as batch:
            batch.write(_tc_batch(per_connection_mbit))
            batch.flush()
            subprocess.run(["ip", "netns", "exec", NAMESPACE, "tc", "-batch", batch.name],
                           check=True, capture_output=True, text=True)
    except BaseException:
        tear_down()
        raise
    return ShapedLink(NAMESPACE, SERVER_ADDR, per_connection_mbit)


def tear_down() -> None:
    """Remove the namespace and the veth pair; quiet when there is nothing to remove."""
    _ip("netns", "del", NAMESPACE, check=False)
    _ip("link", "del", CLIENT_IF, check=False)


def in_namespace(command: list[str]) -> list[str]:
    return ["ip", "netns", "exec", NAMESPACE, *command]
