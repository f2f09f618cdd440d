"""rt serve against a real `vllm serve`, request for request: the same requests (`cases.py`)
to both servers, and a table of where their answers' shapes differ (status, media type, the
JSON keys, an error's type/code/param, usage counts; `tests/backends/serve/api_shape.py`).

    PYTHONPATH=. python docs/tools/api_diff/diff.py --vllm http://127.0.0.1:18200 \
        --rt http://127.0.0.1:18201 [--save DIR] [--freeze FILE]

Both servers serve the same model directory (the tiny Llama, `--max-model-len 2048`): see
README.md here for the commands. `--freeze FILE` writes the requests and vLLM's answers'
shapes as `tests/backends/serve/test_api_diff.py` replays them. A development tool: rt's
tests never run vLLM.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from cases import Case, all_cases  # noqa: E402

from tests.backends.serve.api_shape import (  # noqa: E402
    answer_shape,
    brief,
    differences,
    harmless,
)

TIMEOUT_S = 60.0  # one answer; longer counts as a hang


def served_model(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def ask(client: httpx.Client, case: Case, model: str) -> dict[str, Any]:
    """`case`'s answer's shape from the server behind `client` (status "timeout" on none)."""
    body = None if case.body is None else case.body.replace(b"@MODEL@", model.encode())
    try:
        response = client.request(case.method, case.path, content=body,
                                  headers=case.headers)
    except httpx.TimeoutException:
        return {"status": "timeout", "media": "none", "body": "none"}
    return answer_shape(response.status_code, response.headers.get("content-type"),
                        response.content)


def answers(url: str, cases: list[Case]) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        model = served_model(client)
        return [ask(client, case, model) for case in cases]


def table(cases: list[Case], ours: list[dict[str, Any]], theirs: list[dict[str, Any]]
          ) -> tuple[list[str], Counter[str]]:
    """One markdown row per differing field that a client may tell apart (`| case | field |
    rt | vLLM |`), and how many differences each harmless kind covered."""
    rows, covered = [], Counter[str]()
    for case, a, b in zip(cases, ours, theirs, strict=True):
        for difference in differences(a, b):
            reason = harmless(difference)
            if reason is not None:
                covered[reason] += 1
                continue
            path, mine, vllm = difference
            rows.append(f"| {case.name} | {path} | {brief(mine)} | {brief(vllm)} |")
    return rows, covered


def frozen(cases: list[Case], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fixture: each request (its body base64, `@MODEL@` in place) with vLLM's shape."""
    return {"source": "vLLM 0.32.0 (vllm serve, CPU), docs/tools/api_diff/diff.py --freeze",
            "cases": [{"name": c.name, "method": c.method, "path": c.path,
                       "body_b64": None if c.body is None
                       else base64.b64encode(c.body).decode(),
                       "headers": c.headers, "vllm": answer}
                      for c, answer in zip(cases, theirs, strict=True)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", required=True, help="vLLM's base URL")
    ap.add_argument("--rt", required=True, help="rt serve's base URL")
    ap.add_argument("--save", type=Path, help="write both sides' shapes here (JSON)")
    ap.add_argument("--freeze", type=Path, help="write the requests + vLLM's shapes here")
    args = ap.parse_args()
    cases = all_cases()
    theirs = answers(args.vllm, cases)
    ours = answers(args.rt, cases)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for name, side in (("vllm", theirs), ("rt", ours)):
            (args.save / f"{name}.json").write_text(json.dumps(
                [{"name": c.name, **a} for c, a in zip(cases, side, strict=True)], indent=1))
    if args.freeze:
        fixture = frozen(cases, theirs)
        lines = ",\n".join(json.dumps(case) for case in fixture["cases"])  # one case a line
        args.freeze.write_text(f'{{"source": {json.dumps(fixture["source"])},\n'
                               f'"cases": [\n{lines}\n]}}\n')
    rows, covered = table(cases, ours, theirs)
    differing = len({row.split(" | ")[0] for row in rows})
    print("| case | field | rt | vLLM |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(cases)} requests, {differing} with differences ({len(rows)} fields); "
          "harmless, not listed:")
    for reason, count in covered.most_common():
        print(f"  {count:4d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
