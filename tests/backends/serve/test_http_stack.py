"""uvicorn's loop and parser: uvloop and httptools when both import, asyncio and h11 when
either does not, named in `rt serve`'s start-up line."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("uvicorn")

from backends.serve.api_server import HttpStack, http_stack  # noqa: E402


def test_the_c_pair_when_both_import() -> None:
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    assert http_stack() == HttpStack("uvloop", "httptools")


@pytest.mark.parametrize("missing", ["uvloop", "httptools"])
def test_the_pure_python_pair_when_one_is_missing(missing: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # `import` then raises ImportError
    assert http_stack() == HttpStack("asyncio", "h11")


def test_the_start_up_line_names_them() -> None:
    assert HttpStack("asyncio", "h11").describe() == \
        "uvicorn with the asyncio event loop and the h11 HTTP parser"
