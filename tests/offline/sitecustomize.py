"""Imported at start-up by every Python process whose PYTHONPATH names this folder (the test's
jobs): a connection to anything but this machine (loopback, a Unix socket) is refused and
written to $ALIGNFLOW_NETWORK_LOG, so a test sees whether its jobs tried the network."""

import ipaddress
import os
import socket

_connect = socket.socket.connect


def _local(address) -> bool:
    if not isinstance(address, tuple):  # AF_UNIX
        return True
    host = address[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _guarded(self, address):
    if not _local(address):
        with open(os.environ["ALIGNFLOW_NETWORK_LOG"], "a") as log:
            log.write(f"{os.getpid()} {address}\n")
        raise OSError(f"network refused by the test's offline guard: {address}")
    return _connect(self, address)


if os.environ.get("ALIGNFLOW_NETWORK_LOG"):
    socket.socket.connect = _guarded
