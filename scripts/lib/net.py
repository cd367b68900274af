#!/usr/bin/env python3
"""Network checks used by scripts/dev (python3 stdlib only).

  net.py free-ports COUNT [PREFERRED ...]  print COUNT free TCP ports on 127.0.0.1, one a line
  net.py port-free PORT                    exit 0 if PORT can be bound on 127.0.0.1
  net.py amqp-ready HOST PORT              exit 0 if an AMQP 0-9-1 broker answers there
"""
import random
import socket
import struct
import sys

# Ports are drawn below Linux's ephemeral range (32768-60999) so they cannot collide
# with outgoing connections, and away from RabbitMQ's defaults (5672, 25672, 35672+).
LOW, HIGH = 20000, 32000


def port_free(port: int) -> bool:
    """True when nothing listens on (or holds) the port. SO_REUSEADDR, as servers set it,
    so that connections of an earlier run lingering in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, preferred: list[int]) -> list[int]:
    chosen: list[int] = []
    for port in preferred:
        if len(chosen) < count and port not in chosen and port_free(port):
            chosen.append(port)
    for port in random.sample(range(LOW, HIGH), HIGH - LOW):
        if len(chosen) == count:
            break
        if port not in chosen and port_free(port):
            chosen.append(port)
    if len(chosen) < count:
        sys.exit("no free TCP ports found")
    return chosen


def amqp_ready(host: str, port: int) -> bool:
    """Send the AMQP 0-9-1 protocol header and expect connection.start (class 10, method 10)."""
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.settimeout(3)
            s.sendall(b"AMQP\x00\x00\x09\x01")
            header = b""
            while len(header) < 11:
                chunk = s.recv(11 - len(header))
                if not chunk:
                    return False
                header += chunk
            frame_type, channel, _size, class_id, method_id = struct.unpack(">BHIHH", header)
            return frame_type == 1 and channel == 0 and (class_id, method_id) == (10, 10)
    except OSError:
        return False


def main() -> None:
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "free-ports":
        print("\n".join(str(p) for p in free_ports(int(args[1]), [int(p) for p in args[2:] if p])))
    elif len(args) == 2 and args[0] == "port-free":
        sys.exit(0 if port_free(int(args[1])) else 1)
    elif len(args) == 3 and args[0] == "amqp-ready":
        sys.exit(0 if amqp_ready(args[1], int(args[2])) else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
