"""Structured logs of the gateway: one JSON object per line on stderr.

``tollgate gateway`` hands ``LOG_CONFIG`` to uvicorn, which applies it in every worker process, so the
gateway's own loggers (``tollgate.*``) and uvicorn's (``uvicorn.error``) all write lines like::

    {"ts": "2026-11-22T04:31:07.123456Z", "level": "WARNING", "logger": "tollgate.gateway.generation",
     "message": "engine failed request req_…: …", "request_id": "req_…", "pid": 4242}

``request_id`` is the ``x-request-id`` the client received (``gateway.middleware`` sets it in a context
variable for the whole request, streams and their cleanup included); it is absent outside a request.
Exceptions add ``exc_type`` and ``traceback`` (one string: the line stays one line). Encoding uses
orjson; a value it cannot encode is rendered with ``str``.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from typing import Any

import orjson

from gateway.middleware import request_id_var

_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime",
                                                                                    "request_id"}


class JsonFormatter(logging.Formatter):
    """``logging.Formatter`` producing one JSON object per record (extra= fields included)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": os.getpid(),
        }
        request_id = request_id_var.get()
        if request_id != "-":
            body["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                body[key] = value
        if record.exc_info:
            body["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            body["traceback"] = self.formatException(record.exc_info)
        elif record.stack_info:
            body["traceback"] = self.formatStack(record.stack_info)
        return orjson.dumps(body, default=str).decode()


def log_config(level: str = "INFO") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn's ``log_config``: JSON lines on stderr."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "gateway.logging.JsonFormatter"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                                "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level, "propagate": False},
            "uvicorn.access": {"handlers": ["stderr"], "level": level, "propagate": False},
        },
        "root": {"handlers": ["stderr"], "level": level},
    }
