"""rt command line: the only module that touches argv, the environment and logging.

Each command builds frozen configs from its flags, calls one library function, and prints.
User errors (bad flags, bad files) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
    name="rt",
    help="LLM-serving runtime twin: one vLLM-V1 scheduler/KV core, simulated or real.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks that write JSON.", no_args_is_help=True)
trace_app = typer.Typer(help="Generate, inspect and convert request traces.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")


def fail(message: str) -> NoReturn:
    """Print one readable line for a user error and exit with status 2."""
    typer.echo(f"rt: error: {message}", err=True)
    raise typer.Exit(code=2)


def _write_json(data: object, out: Path | None) -> None:
    text = json.dumps(data, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    sys.stdout.write(text + "\n")


# ---- rt trace ... (workloads) --------------------------------------------------------------
# (trace commands are defined below this line)


# ---- rt bench ... ---------------------------------------------------------------------------


def main() -> None:
    app()


if __name__ == "__main__":
    main()
