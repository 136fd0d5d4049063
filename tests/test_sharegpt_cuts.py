"""A ShareGPT .json file cut at ANY byte is read up to its last complete record, with what was dropped
said: inside a string, an escape (\\", \\\\, \\uXXXX, a surrogate pair), a number, a literal or a
multi-byte UTF-8 character. Damage that is not a cut, and nesting past the decoder's depth, are
errors naming the record. Every cut position of a small file is tried."""
import json

import pytest

from draftlab.errors import UserError
from draftlab.data.prompts import read_prompt_file
from draftlab.data.sharegpt import read_json_array

RECORDS = [
    {"id": "a1", "conversations": [{"from": "human", "value": "Café \"q\" \\ tab\t new\nline 中 😀 \u2028"},
                                   {"from": "gpt", "value": "ok", "score": -1.5e-3, "n": 12345, "t": True, "f": False, "z": None}]},
    {"id": "b2", "conversations": [{"from": "human", "value": "second [with] {braces}, \"and\" a ] bracket 中 😀"}], "meta": [[1, 2.5], []]},
    {"id": "c3", "conversations": [{"from": "human", "value": "third"}, {"from": "gpt", "value": "ünï"}]},
]


def layouts() -> dict[str, bytes]:
    return {"escaped ASCII, indented": (json.dumps(RECORDS, ensure_ascii=True, indent=2) + "\n").encode(),
            "raw UTF-8, compact": json.dumps(RECORDS, ensure_ascii=False).encode(),
            "with a byte-order mark": b"\xef\xbb\xbf" + json.dumps(RECORDS, ensure_ascii=False, indent=1).encode()}


def record_ends(data: bytes) -> list[int]:
    """The byte offset just past each record of the whole file."""
    text = data.decode("utf-8-sig")
    bom = len(data) - len(text.encode())
    decoder, pos, ends = json.JSONDecoder(), text.index("[") + 1, []
    for _ in RECORDS:
        pos = text.index("{", pos)
        _, pos = decoder.raw_decode(text, pos)
        ends.append(bom + len(text[:pos].encode()))
    return ends


@pytest.mark.parametrize("layout", sorted(layouts()))
def test_every_cut_position_reads_the_complete_records(tmp_path, layout):
    data = layouts()[layout]
    ends = record_ends(data)
    path = tmp_path / "sg.json"
    for cut in range(len(data) + 1):
        path.write_bytes(data[:cut])
        complete = sum(end <= cut for end in ends)
        if complete == 0:
            with pytest.raises(UserError, match=r"is empty|ends inside its first record|not a ShareGPT"):
                read_json_array(path)
            continue
        got = read_json_array(path)
        assert [r for _, r in got.records] == RECORDS[:complete], cut
        whole = cut > data.rindex(b"]")  # the array's closing bracket is in
        assert (got.truncated is None) == whole, cut
        if not whole:  # what follows the last complete record: a comma, spaces, the start of the cut one
            dropped = len(data[ends[complete - 1]:cut].lstrip(b" \t\r\n,"))
            assert got.truncated == {"records": complete, "dropped_bytes": dropped}, cut


@pytest.mark.parametrize("layout, inside, offset", [
    ("raw UTF-8, compact", "中".encode(), 1),  # between the bytes of a 3-byte character
    ("raw UTF-8, compact", "😀".encode(), 3),  # inside a 4-byte one
    ("escaped ASCII, indented", b"\\u4e2d", 3),  # inside a \uXXXX escape
    ("escaped ASCII, indented", b"\\ude00", 0),  # between the halves of a surrogate pair
    ("escaped ASCII, indented", b'\\"and', 1),  # right after the backslash of \"
])
def test_a_cut_inside_a_character_or_an_escape_keeps_the_records_before_it(tmp_path, layout, inside, offset):
    data = layouts()[layout]
    ends = record_ends(data)
    cut = data.index(inside, ends[0]) + offset  # inside record 2
    path = tmp_path / "sg.json"
    path.write_bytes(data[:cut])
    got = read_json_array(path)
    start = data.index(b"{", ends[0])
    assert [r for _, r in got.records] == RECORDS[:1] and got.truncated == {"records": 1, "dropped_bytes": cut - start}


@pytest.mark.parametrize("damage, words", [
    (lambda t: t.replace(b'"t": true', b'"t": trux'), r"sg.json:1: record 1 is not valid JSON"),
    (lambda t: t[:-2] + b"x]", r"record 3 is not valid JSON"),
    (lambda t: t.replace(b'"third"', b'"thi\xffrd"'), r"sg.json:1:\d+: not UTF-8 text \(byte 0xff"),
])
def test_damage_is_not_taken_for_a_cut(tmp_path, damage, words):
    path = tmp_path / "sg.json"
    path.write_bytes(damage(json.dumps(RECORDS, ensure_ascii=False).encode()))
    with pytest.raises(UserError, match=words):
        read_json_array(path)


def test_nesting_past_the_bound_names_the_record(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "sg.json"
    path.write_text(f'[{json.dumps(RECORDS[0])},\n{{"id": "deep", "conversations": {deep}}}]')
    with pytest.raises(UserError, match=r"sg.json:2: record 2 is nested too deeply"):
        read_prompt_file(path)


def test_a_huge_role_is_counted_under_a_bounded_name(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": "x", "conversations": [{"from": "R" * 100_000, "value": "hi"}]}]))
    ps = read_prompt_file(path)
    assert max(map(len, ps.roles)) < 100 and max(map(len, ps.skipped)) < 120 and sum(ps.skipped.values()) == 1


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "sg.json"
    path.write_text("[]")

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "read_bytes", denied)
    with pytest.raises(UserError, match=r"prompts.source: cannot read .*sg.json \(Permission denied\)"):
        read_json_array(path)
