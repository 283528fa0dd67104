"""The one text-table drawer every result's table() uses: widths, formats, a status in place of
numbers, None as '-'; checked against hand-written lines."""
from minillm.core.result import Col, text_table

COLS = (Col("engine", 8, left=True), Col("tok/s", 7, ".1f"), Col("share", 7, ".0f", "%"), Col("note", 6))


def test_header_and_rows_line_up_by_width():
    assert text_table(COLS, [["eager", 51.43, 61.5, "ok"], ["graphs", None, 7, "x"]]) == [
        "engine    tok/s  share  note",
        "eager      51.4    62%    ok",
        "graphs        -     7%     x",
    ]


def test_a_short_row_prints_its_status_after_the_columns_before_it():
    assert text_table(COLS, [["llama", "unavailable: no gguf"]]) == [
        "engine    tok/s  share  note",
        "llama   unavailable: no gguf",
    ]
