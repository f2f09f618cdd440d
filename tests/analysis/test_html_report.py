"""The self-contained HTML report (analysis.html_report): nothing fetched, vLLM's block
verbatim, the slowest-requests table with one expandable row per request, "n/a" (never 0)
for what a client-timed run lacks, and, where Chromium is installed, the page rendered in
a real browser (no script errors, the JS sorts and expands, a screenshot saved)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from html import escape
from pathlib import Path

import pytest

from analysis.console import CLIENT_TIMING_NOTE, benchmark_block
from analysis.html_report import html_report, write_html_report
from analysis.metrics import benchmark_metrics
from analysis.rundir import load_run
from tests.analysis.handmade import client_run, fleet_run, pd_run, timeline_run

# Anything a browser would fetch: src/href/url()/@import to a scheme or a protocol-relative
# address, <link> and <script src>.
EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:[a-z]+:|//)|url\(\s*["']?\s*"""
                      r"""(?:[a-z]+:|//)|@import|<link\b|<script[^>]*\bsrc\b""", re.I)


def _rows(text: str) -> list[str]:
    return re.findall(r'<tr class="row">(.*?)</tr>', text, re.S)


def test_a_run_page_is_self_contained(hand_run: Path) -> None:
    text = html_report(load_run(hand_run))
    assert not EXTERNAL.search(text)
    assert "http://" not in text and "https://" not in text  # not even SVG namespaces
    assert text.count("<figure") == 4  # attribution, percentiles, CDFs, timeline
    assert 'data-plot="timeline"' in text


def test_vllm_block_is_verbatim_and_the_table_has_every_completed_request(
        hand_run: Path) -> None:
    run = load_run(hand_run)
    text = html_report(run)
    assert escape(benchmark_block(benchmark_metrics(run.requests, [99.0]),
                                  ("ttft", "tpot", "itl"), [99.0])) in text
    rows = _rows(text)
    assert len(rows) == 3  # A, B, C; D failed
    assert [re.search(r"<td>(\w+)</td>", r).group(1) for r in rows] == ["C", "A", "B"]
    assert text.count('<tr class="detail" hidden>') == 3
    assert 'data-v="320.0' in rows[0]  # C's E2E, ms, raw for sorting


def test_client_timed_run_reads_na_not_zero(tmp_path: Path) -> None:
    text = html_report(client_run(tmp_path))
    assert escape(CLIENT_TIMING_NOTE) in text
    visible = re.sub(r"<script>.*?</script>", "", text, flags=re.S)
    assert not re.search(r"\bnan\b", visible, re.I)
    assert "Timeline: n/a" in text
    for label in ("Preemptions", "Mean KV cache usage (%)", "Engine steps"):
        assert re.search(rf"<td>{re.escape(escape(label))}</td><td[^>]*>n/a</td>", text), label
    rows = _rows(text)
    assert len(rows) == 2
    queue, preemptions = (re.findall(r"<td[^>]*>([^<]*)</td>", rows[0])[i] for i in (8, 9))
    assert (queue, preemptions) == ("n/a", "n/a")
    assert 'data-v="0.0"' not in "".join(rows[0].split("</td>")[8:10])
    assert not EXTERNAL.search(text)  # the endpoint URL is text, not a reference


def test_compare_page_has_the_table_and_each_run(hand_run: Path, tmp_path: Path) -> None:
    path = write_html_report([load_run(hand_run), load_run(hand_run)], tmp_path / "c.html")
    text = path.read_text()
    assert "Side by side" in text and text.count("<details") >= 2
    assert not EXTERNAL.search(text)


def _table(text: str, css_id: str) -> list[list[str]]:
    """The cells' text of each body row of the table with id `css_id`."""
    body = re.search(rf'<table[^>]*id="{css_id}".*?<tbody>(.*?)</tbody>', text, re.S).group(1)
    return [re.findall(r"<td[^>]*>([^<]*)</td>", row)
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)]


def test_fleet_page_has_the_replica_table_and_views(tmp_path: Path) -> None:
    text = html_report(fleet_run(tmp_path))
    assert not EXTERNAL.search(text)
    # replica, requests, share %, prompt tokens, p50/p99 TTFT ms, KV %, hit %, preemptions
    assert _table(text, "replicas") == [
        ["replica 0", "1", "33.3", "200", "50.0", "50.0", "30.8", "0.0", "1"],
        ["replica 1", "2", "66.7", "150", "30.0", "30.0", "62.5", "0.0", "0"]]
    assert re.search(r"Load imbalance, requests \(max/mean\)</td><td[^>]*>1.33<", text)
    assert re.search(r"Jain&#x27;s fairness index, requests</td><td[^>]*>0.900<", text)
    assert 'data-plot="replica timelines"' in text
    assert "Routing (fleet)" in text  # the attribution has the fleet's part
    rows = _rows(text)
    assert [re.findall(r"<td[^>]*>([^<]*)</td>", r)[:2] for r in rows] == [
        ["R", "0"], ["F1", "1"], ["F2", "1"]]  # slowest first, with its replica
    details = re.findall(r"<small>(.*?)</small>", text)
    assert details[1].startswith("routing: 1.0 ms &rarr; API server: 2.0 ms &rarr; "
                                 "step boundary: 2.0 ms &rarr; prefill: 25.0 ms")


def test_pd_page_has_the_prefill_replica_and_the_transfer(tmp_path: Path) -> None:
    text = html_report(pd_run(tmp_path))
    assert "KV transfer (P/D)" in text and ">kv xfer<" in text
    assert [row[:5] for row in _table(text, "replicas")] == [
        ["replica 0 (p, prefill)", "0", "0.0", "0", "1"],  # ... prefilled for others
        ["replica 1 (d, decode)", "1", "100.0", "200", "0"]]
    row = re.findall(r"<td[^>]*>([^<]*)</td>", _rows(text)[0])
    assert row[:3] == ["P", "1", "0"]  # request, replica, prefill replica
    words = re.findall(r"<small>(.*?)</small>", text)[0]
    assert "KV transfer: 5.0 ms (bytes 26214400, from 0, to 1)" in words
    assert words.endswith("prefill: 10.0 ms (chunks 1) &rarr; decode: 20.0 ms (tokens 2)")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Test-only: sort the slowest table by TTFT (ascending), then expand the first row.
CLICKS = ("<script>var h=document.querySelectorAll('#slowest th');h[5].click();"
          "document.querySelector('tr.row').click();</script></body>")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                    "chromium; .ci/run installs it)")
@pytest.mark.parametrize("make_run", [timeline_run, fleet_run], ids=["engine", "fleet"])
def test_page_renders_in_headless_chromium(tmp_path: Path, make_run) -> None:
    run = make_run(tmp_path)
    page = write_html_report(run, tmp_path / "report.html")
    clicked = tmp_path / "clicked.html"
    clicked.write_text(page.read_text().replace("</body>", CLICKS))
    flags = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size=1280,2400"]
    start = time.monotonic()
    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], check=True,
                   capture_output=True, timeout=120)
    elapsed = time.monotonic() - start
    assert shot.stat().st_size > 10_000, "screenshot"
    dom = subprocess.run([*flags, "--dump-dom", clicked.as_uri()], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    error = re.search(r"<html[^>]*data-js-error=\"([^\"]*)\"", dom)
    assert error is None, error.group(1)
    assert 'data-ready="1"' in dom  # the page's script ran to the end
    assert 'data-dir="asc"' in dom  # sorted
    assert dom.count("<svg") >= 4  # the plots are in the DOM
    assert re.search(r'<tr class="detail">', dom), "the first row expanded"
    if "replica" in run.requests.columns:  # the fleet's table and small multiples rendered
        assert re.search(r'<table class="sortable" id="replicas">.*?<td>replica 1</td>', dom,
                         re.S)
        assert re.search(r'<figure data-plot="replica timelines"><svg', dom)
    print(f"rendered in {elapsed:.1f} s; screenshot {shot}")


def test_sweep_page_has_a_sortable_row_per_run(tmp_path: Path) -> None:
    import pandas as pd

    from analysis.html_report import write_sweep_html
    from analysis.plots import latency_vs_rate

    results = pd.DataFrame({"request_rate": [1.0, 2.0, 4.0], "p99_ttft_ms": [10.0, 20.0, 90.0],
                            "p99_itl_ms": [5.0, 6.0, 9.0], "p99_e2el_ms": [50.0, 60.0, 300.0],
                            "meets_slo": [True, True, False], "config": ["a", "a", "a"]})
    path = write_sweep_html(results, tmp_path / "sweep.html",
                            {"latency_vs_rate": latency_vs_rate(results)},
                            slos={"p99_ttft_ms": 50.0})
    text = path.read_text()
    assert text.count("<tr><td") == 3 and 'class="sortable"' in text
    assert '<td data-v="0">no</td>' in text and "p99_ttft_ms &lt;= 50" in text
    assert text.count("<figure") == 1 and not EXTERNAL.search(text)
