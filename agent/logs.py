"""Log setup: structlog for the agent's own events, with library logging routed through the same output.

JSON lines when the log stream is not a terminal (systemd journal, container logs), readable coloured lines
when it is. Logs go to stderr so command output on stdout stays machine-readable.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import FilteringBoundLogger, Processor

__all__ = ["configure_logging", "get_logger"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    level: Literal["debug", "info", "warning", "error"] = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: TextIO | None = None,
) -> None:
    """Configure structlog and the standard library's logging once, at start-up."""
    out = stream or sys.stderr
    as_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer]
        if as_json
        else [*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    # Libraries (grpc, aiohttp, kubernetes) log through the standard library: render them the same way.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS[level], logging.INFO))


def get_logger(name: str) -> FilteringBoundLogger:
    """A logger bound to a component name."""
    logger: FilteringBoundLogger = structlog.get_logger(component=name)
    return logger
