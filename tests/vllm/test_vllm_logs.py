"""kvbridge's log lines inside vLLM (``kvbridge.connector.vllm.logs``): through vLLM's handler
once vLLM configured its logging, never over a configuration the application made."""

from __future__ import annotations

import io
import logging

import pytest


@pytest.fixture
def loggers():
    """The ``kvbridge``, ``vllm`` and root loggers, with vLLM's logging configured as an engine
    does it at start (``vllm.logger.configure_logging``), restored after the test."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    ours, theirs, root = (logging.getLogger(n) for n in ("kvbridge", "vllm", None))
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (ours, theirs, root)]
    configure_logging(LoggingConfig())
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    ours.propagate = True
    root.handlers.clear()
    yield ours, theirs, root
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def test_info_lines_go_through_vllms_handler(loggers):
    """Before: only Python's last resort would print, and no INFO line. After: vLLM's own
    handler (named "vllm") formats kvbridge's INFO line like vLLM's (level, file:line)."""
    from kvbridge.connector.vllm.logs import route_to_vllm

    ours, theirs, root = loggers
    root.handlers.clear()  # as in a vLLM process (pytest adds its capture handler per phase)
    (handler,) = [h for h in theirs.handlers if h.name == "vllm"]  # pytest may add its own
    assert route_to_vllm() and route_to_vllm()  # idempotent
    assert ours.handlers == theirs.handlers and not ours.propagate
    stream = io.StringIO()
    old = handler.setStream(stream)
    try:
        logging.getLogger("kvbridge.connector.worker_half").info("transport listening on %d", 7)
    finally:
        handler.setStream(old)
    line = stream.getvalue()
    assert "INFO" in line and "transport listening on 7" in line, line
    assert "test_vllm_logs.py:" in line, line  # vLLM's [file:line] field


def test_an_application_logging_config_is_left_alone(loggers):
    """A root handler (the application's logging.basicConfig) or a handler on kvbridge itself
    stays the only route."""
    from kvbridge.connector.vllm.logs import route_to_vllm

    ours, _, root = loggers
    root.handlers[:] = [logging.NullHandler()]
    assert route_to_vllm() is False and not ours.handlers and ours.propagate
    root.handlers.clear()
    mine = logging.NullHandler()
    ours.addHandler(mine)
    assert route_to_vllm() is False and ours.handlers == [mine]
