"""What JAX builds inside a block of a test: the names of the functions it traces into programs
(a program a process already holds is run without tracing)."""

from __future__ import annotations

import contextlib
import logging
import re

import jax


class _Names(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if m := re.match(r"Finished tracing (?:\+ transforming )?(\S+) for", record.getMessage()):
            self.names.append(m.group(1))


@contextlib.contextmanager
def traced():
    """Yields the list of the functions traced inside the block, filled as they are."""
    handler, logger = _Names(), logging.getLogger("jax")
    logger.addHandler(handler)
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler.names
    finally:
        jax.config.update("jax_log_compiles", was)
        logger.removeHandler(handler)
