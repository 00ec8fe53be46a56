"""The console log follows ``sys.stdout``: a handler holding the stream it was made with wrote into a closed file
once ``sys.stdout`` was replaced (an entry point's ``main`` run in-process: a notebook cell, pytest's capture), and
every later line of the process was a "--- Logging error ---" traceback on stderr (a CI failure of an unrelated test
that counted tracebacks, after an earlier test in its worker had set logging up)."""

from __future__ import annotations

import io
import logging
import sys

from prime_core.logging import setup_logging


def test_a_line_logged_after_stdout_was_replaced_goes_to_the_new_stdout(monkeypatch, capfd):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # the setup's handlers go with the test
    monkeypatch.setattr(root, "level", root.level)
    first = io.StringIO()
    monkeypatch.setattr(sys, "stdout", first)
    log = setup_logging("orchestrator")
    first.close()  # the stdout of the moment the logging was set up is gone
    now = io.StringIO()
    monkeypatch.setattr(sys, "stdout", now)
    log.info("after the swap")
    assert now.getvalue().endswith(" I [orchestrator] after the swap\n")
    assert "Logging error" not in capfd.readouterr().err
