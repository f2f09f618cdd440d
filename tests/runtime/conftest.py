"""Says at the end of the session what tests/runtime/test_native.py did with the compiled
core (built and compared, or why not), without -rs."""

from __future__ import annotations

from tests.runtime import compiled_core


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    for line in compiled_core.REPORT:
        terminalreporter.write_line(line)
