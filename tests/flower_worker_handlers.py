"""Request handlers for tests/flower/test_flower_worker.py, imported by the radbo worker process.

Each takes the request bytes and returns reply bytes; ``count`` keeps state across requests,
so a reply shows which worker process answered and how many requests it has served.
"""

import os

_served = 0


def count(request: bytes) -> bytes:
    """``b"<worker pid> <requests served so far> <request>"``."""
    global _served
    _served += 1
    return f"{os.getpid()} {_served} {request.decode()}".encode()


def fail(request: bytes) -> bytes:
    raise ValueError(f"bad request {request.decode()}")


def not_bytes(request: bytes) -> bytes:
    return len(request)  # type: ignore[return-value]  # deliberately wrong


def echo(request: bytes) -> bytes:
    return request
