"""Building blocks of the HTML reports: the page shell (inline CSS and a little vanilla JS,
nothing fetched), tables, figures as inline SVG, and value formatting ("n/a" for what a run
lacks, never 0)."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from html import escape

import matplotlib
from matplotlib.figure import Figure

NA = "n/a"
# matplotlib's tab10, so the HTML bars match the attribution figure (C0..C9).
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
         "#7f7f7f", "#bcbd22", "#17becf")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;
 max-width:1200px;padding:0 16px 40px;color:#1b1b1b}
h1{font-size:22px;margin:18px 0 4px}h2{font-size:18px;margin:28px 0 8px;
 border-bottom:1px solid #ddd;padding-bottom:4px}h3{font-size:15px;margin:16px 0 6px}
.sub{color:#555;margin:0 0 10px}.note{background:#fff6d6;border:1px solid #e8d48a;
 padding:6px 10px;border-radius:4px}.na{color:#999}
pre{background:#f6f6f6;padding:10px;overflow-x:auto;font-size:12.5px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}th{background:#fafafa;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th[data-dir=asc]::after{content:" \\25B2"}
table.sortable th[data-dir=desc]::after{content:" \\25BC"}
tr.row{cursor:pointer}tr.row:hover{background:#f2f7ff}tr.detail>td{background:#fbfbfb;
 text-align:left;white-space:normal}
.bar{display:flex;height:16px;width:100%;max-width:900px;border:1px solid #ccc;margin:4px 0}
.bar>span{display:block;height:100%}.gantt{position:relative;height:18px;max-width:900px;
 border:1px solid #ccc;margin:4px 0;background:#fff}.gantt>span{position:absolute;top:0;
 bottom:0}.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
figure{margin:8px 0}figure svg{width:100%;height:auto}details>summary{cursor:pointer}
.share{display:inline-block;height:9px;background:#1f77b4;vertical-align:middle}
"""

# In <head>: an uncaught script error is written on <html data-js-error> (tests read it).
ERROR_TRAP = ("window.addEventListener('error',function(e){document.documentElement"
              ".setAttribute('data-js-error',String(e.message))});")
JS = """
document.querySelectorAll('table.sortable').forEach(function (table) {
  var heads = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(heads, function (th, col) {
    th.addEventListener('click', function () { sortTable(table, th, col); });
  });
  table.tBodies[0].addEventListener('click', function (ev) {
    var row = ev.target.closest('tr.row');
    if (row && row.nextElementSibling && row.nextElementSibling.classList.contains('detail'))
      row.nextElementSibling.hidden = !row.nextElementSibling.hidden;
  });
});
function cellKey(row, col) {
  var cell = row.cells[col], v = cell.getAttribute('data-v');
  if (v === null) return cell.textContent;
  return v === '' ? NaN : parseFloat(v);
}
function sortTable(table, th, col) {
  var asc = th.getAttribute('data-dir') !== 'asc', body = table.tBodies[0];
  Array.prototype.forEach.call(table.tHead.rows[0].cells,
                               function (h) { h.removeAttribute('data-dir'); });
  th.setAttribute('data-dir', asc ? 'asc' : 'desc');
  var pairs = Array.prototype.filter.call(body.rows, function (r) {
    return !r.classList.contains('detail');
  }).map(function (r) {
    var d = r.nextElementSibling;
    return [r, d && d.classList.contains('detail') ? d : null];
  });
  pairs.sort(function (a, b) {
    var x = cellKey(a[0], col), y = cellKey(b[0], col);
    var xn = typeof x === 'number' && isNaN(x), yn = typeof y === 'number' && isNaN(y);
    if (xn || yn) return xn - yn;  // n/a last either way
    var c = x < y ? -1 : x > y ? 1 : 0;
    return asc ? c : -c;
  });
  pairs.forEach(function (p) { body.appendChild(p[0]); if (p[1]) body.appendChild(p[1]); });
}
document.body.setAttribute('data-ready', '1');
"""


def is_missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt(value: object, spec: str = ".2f") -> str:
    """A value for a cell: "n/a" when missing, else formatted (ints as ints)."""
    if is_missing(value):
        return NA
    if isinstance(value, bool) or not isinstance(value, int | float):
        return escape(str(value))
    if isinstance(value, int) or (spec == "d" and float(value).is_integer()):
        return f"{int(value):,}"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def cell(value: object, spec: str = ".2f") -> str:
    """A <td> whose data-v carries the raw number for sorting ('' when missing)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raw = "" if is_missing(value) else repr(float(value))
        css = ' class="na"' if is_missing(value) else ""
        return f'<td data-v="{raw}"{css}>{fmt(value, spec)}</td>'
    return f"<td>{fmt(value, spec)}</td>"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], sortable: bool = False,
          css_id: str | None = None) -> str:
    """An HTML table; each row is a list of ready <td> strings."""
    attrs = (' class="sortable"' if sortable else "") + (f' id="{css_id}"' if css_id else "")
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "\n".join(f"<tr>{''.join(r)}</tr>" for r in rows)
    return f"<table{attrs}><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>"


_SVG_HEAD = re.compile(r"^.*?(?=<svg)", re.S)
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)
_XMLNS = re.compile(r'\s+xmlns(:\w+)?="[^"]*"')
_SIZE = re.compile(r'<svg([^>]*?)\swidth="([\d.]+)pt"\s+height="([\d.]+)pt"')


def svg(fig: Figure, title: str) -> str:
    """The figure as inline SVG inside a <figure>: text kept as text (small), no XML
    prologue, metadata or namespace URLs (inline SVG in HTML needs none), scaled to the
    page width up to its natural size."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "rt"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = _METADATA.sub("", _SVG_HEAD.sub("", buffer.getvalue(), count=1))
    text = _XMLNS.sub("", text)
    text = _SIZE.sub(lambda m: f'<svg{m.group(1)} style="max-width:{m.group(2)}pt" '
                               f'role="img" aria-label="{escape(title)}"', text, count=1)
    return f'<figure data-plot="{escape(title)}">{text}</figure>'


def page(title: str, body: str) -> str:
    """The whole document: one file, CSS and JS inline."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><script>{ERROR_TRAP}</script><style>{CSS}</style></head>\n<body>\n{body}\n"
            f"<script>{JS}</script>\n</body></html>\n")


def na_block(what: str, why: str) -> str:
    return f'<p class="note">{escape(what)}: n/a ({escape(why)})</p>'
