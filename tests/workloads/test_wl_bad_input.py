"""Bad trace files raise one TraceError naming file, line, column and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from workloads import TraceError, detect_format, load_trace
from workloads.loaders import read_rows

from .helpers import FIXTURES, write

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW0 = "2023-11-16 18:15:46.6805900,374,44\n"
ROW1 = "2023-11-16 18:15:50.9951690,396,109\n"
MOON = '{"timestamp": %s, "input_length": %s, "output_length": %s, "hash_ids": %s}\n'
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
BURST = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
RT_HEAD = '{"format": "rt-trace", "version": 1, "name": "x", "requests": 1}\n'

CASES = {
    "misnamed column": (AZURE.replace("ContextTokens", "Context Tokens") + ROW0, None,
                        1, "ContextTokens", None, "did you mean 'Context Tokens'"),
    "non-numeric": (AZURE + ROW0 + ROW1.replace("396", "abc"), None,
                    3, "ContextTokens", "abc", "not a finite number"),
    "negative": (AZURE + ROW0 + ROW1.replace("109", "-4"), None,
                 3, "GeneratedTokens", "-4", ">= 0"),
    "NaN": (AZURE + ROW0.replace("374", "NaN"), None, 2, "ContextTokens", "NaN", "finite"),
    "fraction": (AZURE + ROW0.replace("374", "37.5"), None, 2, "ContextTokens", "37.5",
                 "integers"),
    "empty cell": (AZURE + ROW0 + "2023-11-16 18:15:50.9951690,,109\n", None,
                   3, "ContextTokens", "", "finite"),
    "bad datetime": (AZURE + ROW0.replace("2023-11-16", "16/11/2023"), None,
                     2, "TIMESTAMP", "16/11/2023 18:15:46.6805900", "date-time"),
    "unsorted": (AZURE + ROW1 + ROW0, None, 3, "TIMESTAMP", "2023-11-16 18:15:46.6805900",
                 "sorted"),
    "ragged row": (AZURE + ROW0 + "2023-11-16 18:15:50.9951690,396,109,7\n", None,
                   3, None, None, "4 fields"),
    "blank line": (AZURE + ROW0 + "\n" + ROW1, None, 3, "TIMESTAMP", "", "date-time"),
    "header only": (AZURE, None, 2, None, None, "no data rows"),
    "empty file": ("", None, 1, None, None, "empty file"),
    "unknown header": ("a,b,c\n1,2,3\n", None, 1, None, "a,b,c", "unrecognised"),
    "wrong format": (AZURE + ROW0, "mooncake", 1, None, AZURE.strip(), "invalid JSON"),
    "csv as vidur": (AZURE + ROW0, "vidur", 1, "arrived_at", None, "missing column"),
    "mooncake missing key": ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n',
                             "mooncake", 1, "output_length", None, "missing key"),
    "mooncake negative time": (MOON % ("-3", 5, 1, "[1]"), None, 1, "timestamp", -3, ">= 0"),
    "mooncake too many ids": (MOON % (0, 5, 1, "[0]") + MOON % (7, 513, 1, "[0, 1, 2]"), None,
                              2, "hash_ids", 3, "exceed"),
    "mooncake bad id": (MOON % (0, 5, 1, '[0, "x"]'), None, 1, "hash_ids", "x", "integers"),
    "mooncake unsorted": (MOON % (9, 5, 1, "[0]") + MOON % (7, 5, 1, "[0]"), None,
                          2, "timestamp", 7.0, "sorted"),
    "mooncake float length": (MOON % (0, 5.5, 1, "[0]"), None, 1, "input_length", 5.5,
                              "integer"),
    # once -9223372036854775808 named as the value (the int64 cast of 1e23)
    "vidur huge count": (VIDUR + "0.0,99999999999999999999999,10\n", None, 2,
                         "num_prefill_tokens", "99999999999999999999999", "<= 16,777,216"),
    # once a numpy error after the work (1e300 s), a hang (a 10,000-year span)
    "burstgpt late arrival": (BURST + "5,ChatGPT,4,1,5,x\n1e300,ChatGPT,4,1,5,x\n", None, 3,
                              "arrival_s", 1e300, "<= 16,777,216 s"),
    "mooncake late arrival": (MOON % (0, 5, 1, "[0]") + MOON % ("1e305", 5, 1, "[0]"), None,
                              2, "arrival_s", None, "arrival time must be <= 16,777,216 s"),
    # once "timestamps must be sorted": 1600's nanoseconds wrapped around past 2000's
    "azure four centuries": (AZURE + "1600-01-01 00:00:00,10,2\n2000-01-01 00:00:10,10,2\n",
                             None, 3, "arrival_s", 12622780810.0, "<= 16,777,216 s"),
    # once a RecursionError traceback
    "mooncake nested JSON": (MOON % (0, 5, 1, "[0]") + "[" * 5000 + "]" * 5000 + "\n", None,
                             2, None, None, "nested too deeply"),
    "rt nested JSON": (RT_HEAD + "{\"a\": " * 5000 + "1" + "}" * 5000 + "\n", None, 2, None,
                       None, "nested too deeply"),
    # once _csv.Error: field larger than field limit (131072)
    "long first line": ("[" * 200_000 + "\n", None, 1, None, None, "unrecognised"),
    # badinput4: JSON's escapes spell a lone surrogate; once "'utf-8' codec can't encode
    # character '\\ud800'" after the run (writing requests.parquet), nothing named
    "rt lone surrogate id": (RT_HEAD + '{"id": "a\\ud800", "arrival_s": 0, "prompt_len": 5, '
                             '"output_len": 1}\n', None, 2, "request_id", "a\ud800",
                             "lone surrogate"),
    "rt lone surrogate segment": (RT_HEAD + '{"id": "a", "arrival_s": 0, "prompt_len": 5, '
                                  '"output_len": 1, "segments": [["\\udfff", 5]]}\n', None, 2,
                                  "segments", "\udfff", "lone surrogate"),
    "rt lone surrogate session": (RT_HEAD + '{"id": "a", "arrival_s": 0, "prompt_len": 5, '
                                  '"output_len": 1, "session_id": "\\udc00"}\n', None, 2,
                                  "session_id", "\udc00", "lone surrogate"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_file_is_located(tmp_path: Path, case: str) -> None:
    text, fmt, line, column, value, fragment = CASES[case]
    suffix = ".jsonl" if text.startswith("{") else ".csv"
    path = write(tmp_path / f"bad{suffix}", text)
    with pytest.raises(TraceError) as info:
        load_trace(path, fmt)
    err = info.value
    assert (err.path, err.line, err.column) == (str(path), line, column)
    if value is not None:
        assert err.value == value
    assert fragment in str(err)
    assert "\n" not in str(err)


def test_a_late_arrival_is_refused_in_every_row_too(tmp_path: Path) -> None:
    """`rt trace inspect --keep-failed` reads the rows without building requests."""
    path = write(tmp_path / "late.csv", BURST + "5,ChatGPT,4,0,4,x\n1e300,ChatGPT,4,0,4,x\n")
    with pytest.raises(TraceError) as info:
        read_rows(path)
    assert (info.value.line, info.value.column, info.value.value) == (3, "arrival_s", 1e300)


def test_a_missing_column_names_a_long_header_briefly(tmp_path: Path) -> None:
    path = write(tmp_path / "long.csv", "a" * 200_000 + ",b\n1,2\n")
    with pytest.raises(TraceError) as info:
        load_trace(path, "azure")
    assert str(info.value) == (f"{path}:1: column 'TIMESTAMP': missing column (header has "
                               f"'{'a' * 37}...', 'b')")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.csv")


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "blob.csv"
    path.write_bytes(b"\xff\xfe\x00\x81garbage\n")
    with pytest.raises(TraceError, match="UTF-8") as info:
        load_trace(path)
    assert info.value.path == str(path)


def test_unknown_model_lists_the_models() -> None:
    with pytest.raises(TraceError, match="ChatGPT, GPT-4") as info:
        load_trace(FIXTURES / "burstgpt_head.csv", model="GPT-5")
    assert (info.value.column, info.value.value) == ("--trace-model", "GPT-5")


def test_model_filter_needs_a_model_column() -> None:
    with pytest.raises(TraceError) as info:
        load_trace(FIXTURES / "azure_code_2023_first1000.csv", model="GPT-4")
    assert info.value.column == "--trace-model"


@pytest.mark.parametrize(("name", "fmt"), [
    ("azure_conv_2023_head.csv", "azure"), ("burstgpt_head.csv", "burstgpt"),
    ("burstgpt3_head.csv", "burstgpt"), ("mooncake_synthetic_first200.jsonl", "mooncake"),
    ("sharegpt_lengths_first1000.csv", "lengths"),
])
def test_detection(name: str, fmt: str) -> None:
    assert detect_format(FIXTURES / name) == fmt


def test_vidur_and_bailian_formats(tmp_path: Path) -> None:
    vidur = write(tmp_path / "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens,x\n"
                  "0.5,10,2,a\n1.25,20,3,b\n")
    trace = load_trace(vidur).trace
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in trace] == [(0.0, 10, 2),
                                                                         (0.75, 20, 3)]
    rows = [
        '{"chat_id": 10, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 20, '
        '"output_length": 4, "type": "text", "turn": 1, "hash_ids": [1, 2]}',
        '{"chat_id": 11, "parent_chat_id": -1, "timestamp": 2.0, "input_length": 5, '
        '"output_length": 2, "type": "text", "turn": 1, "hash_ids": [3]}',
        '{"chat_id": 12, "parent_chat_id": 10, "timestamp": 4.0, "input_length": 60, '
        '"output_length": 4, "type": "text", "turn": 2, "hash_ids": [1, 2, 4]}',
    ]
    bailian = write(tmp_path / "b.jsonl", "\n".join(rows) + "\n")
    result = load_trace(bailian)
    assert result.report.format == "bailian"
    got = [(r.request_id, r.session_id, r.arrival_s, r.hash_block_size, r.hash_covered_len)
           for r in result.trace]
    assert got == [("10", "10", 0.0, 16, 20), ("11", "11", 0.5, 16, 5),
                   ("12", "10", 2.5, 16, 48)]
    assert result.report.uncovered_hash_rows == 1  # 60 tokens need 4 blocks of 16, 3 given


def test_byte_order_mark_is_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (AZURE + ROW0 + ROW1).encode())
    trace = load_trace(path).trace
    assert [(r.arrival_s, r.prompt_len) for r in trace] == [(0.0, 374), (4.314579, 396)]


def test_byte_order_mark_is_tolerated_in_rt_jsonl(tmp_path: Path) -> None:
    """Once "invalid JSON (Unexpected UTF-8 BOM ...)" on line 1, where every other format
    read it."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (RT_HEAD + '{"id": "a", "arrival_s": 0.5, '
                                          '"prompt_len": 3, "output_len": 2}\n').encode())
    assert [(r.request_id, r.arrival_s) for r in load_trace(path).trace] == [("a", 0.5)]


def test_a_bad_flag_is_named_as_a_flag_and_a_bad_cell_as_a_column() -> None:
    flag = TraceError("must be > 0", column="--time-scale", value=0.0)
    cell = TraceError("not a finite number", path="t.csv", line=3, column="ContextTokens",
                      value="x7")
    assert str(flag) == "--time-scale: value 0.0: must be > 0"
    assert str(cell) == "t.csv:3: column 'ContextTokens': value 'x7': not a finite number"


def test_dates_outside_the_nanosecond_range_keep_their_gaps(tmp_path: Path) -> None:
    path = write(tmp_path / "old.csv", AZURE + "1500-01-01 00:00:00,10,2\n"
                 "1500-01-01 00:00:10,10,2\n")
    assert [r.arrival_s for r in load_trace(path).trace] == [0.0, 10.0]
