import json

import pytest

from specheads.data.sources import (EMPTY_TURN, INVALID_JSON, NO_ASSISTANT, NOT_CONVERSATION, UNKNOWN_ROLE,
                                    SkipReport, SourceError, iter_conversations)


def chat(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


GOOD = [chat(0, ("human", "hi"), ("gpt", "hello")),
        chat(1, ("system", "be nice"), ("user", "q"), ("chatgpt", "a"), ("human", "q2"), ("bard", "a2")),
        chat(2, ("gpt", "leading answer"), ("human", "q"), ("bing", "a"))]
BAD = [chat(3, ("human", "only a question")),            # no assistant turn
       chat(4, ("human", "q"), ("robot", "a")),           # unknown role
       chat(5, ("human", ""), ("gpt", "a")),              # empty turn
       {"id": "c6", "conversations": []},                 # not a conversation
       ["not", "a", "dict"]]                              # not a conversation


def test_sharegpt_roles_normalized_and_skips_counted(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(GOOD + BAD))
    report = SkipReport()
    convs = list(iter_conversations("sharegpt", str(path), report=report))
    assert [c.id for c in convs] == ["c0", "c1", "c2"]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[2].messages[0] == {"role": "user", "content": "q"}  # leading assistant turn dropped
    assert report.counts == {NO_ASSISTANT: 1, UNKNOWN_ROLE: 1, EMPTY_TURN: 1, NOT_CONVERSATION: 2}
    assert report.read == 8 and report.kept == 3 and report.stopped_early is None
    assert "'robot'" in report.examples[UNKNOWN_ROLE]


def test_truncated_json_yields_whole_records_and_says_where(tmp_path):
    text = json.dumps(GOOD)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"c2"') + 10])  # cut inside the third record
    report = SkipReport()
    convs = list(iter_conversations("sharegpt", str(path), report=report))
    assert [c.id for c in convs] == ["c0", "c1"]
    assert "cut off after 2 whole records" in report.stopped_early


def test_messages_jsonl_and_invalid_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"id": "a", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
             "{not json", "", json.dumps({**chat(9, ("human", "1+1"), ("gpt", "2")), "id": "b", "domain": "math"})]
    path.write_text("\n".join(lines))
    report = SkipReport()
    convs = list(iter_conversations("auto", str(path), report=report))
    assert [c.id for c in convs] == ["a", "b"] and convs[1].domain == "math"
    assert report.counts[INVALID_JSON] == 1 and "m.jsonl:2" in report.examples[INVALID_JSON]


def test_hf_dataset_from_disk(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"id": "h", "messages": [{"role": "user", "content": "u"},
                                                          {"role": "assistant", "content": "v"}]}]).save_to_disk(tmp_path / "ds")
    convs = list(iter_conversations("hf", str(tmp_path / "ds")))
    assert convs[0].messages[1]["content"] == "v"


@pytest.mark.parametrize("content, match", [(b"", "empty"), (b"hello, not json", "not a JSON array"),
                                            (b'{"id": 1}', "not a JSON array")])
def test_unreadable_files_get_clear_errors(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(SourceError, match=match):
        list(iter_conversations("sharegpt", str(path)))


def test_missing_file_and_unknown_source(tmp_path):
    with pytest.raises(SourceError, match="not found"):
        list(iter_conversations("jsonl", str(tmp_path / "nope.jsonl")))
    with pytest.raises(SourceError, match="unknown source"):
        list(iter_conversations("parquet", "x"))


@pytest.mark.slow
def test_packaged_sharegpt_streams_every_whole_record():
    report = SkipReport()
    n = sum(1 for _ in iter_conversations("sharegpt", report=report))
    assert report.read == 17671, "the packaged file holds 17,671 whole conversations before the cut"
    assert n == report.kept == 17671 - sum(report.counts.values())
    assert report.stopped_early and "17671 whole records" in report.stopped_early


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    """Windows editors save JSON with a UTF-8 BOM; it was refused as 'not a JSON array'."""
    bom = b"\xef\xbb\xbf"
    sg = tmp_path / "bom.json"
    sg.write_bytes(bom + json.dumps(GOOD).encode())
    assert [c.id for c in iter_conversations("sharegpt", str(sg))] == ["c0", "c1", "c2"]
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(bom + "\n".join(json.dumps(r) for r in GOOD).encode())
    report = SkipReport()
    assert [c.id for c in iter_conversations("jsonl", str(jl), report=report)] == ["c0", "c1", "c2"]
    assert not report.counts
    utf16 = tmp_path / "u16.json"
    utf16.write_bytes(json.dumps(GOOD).encode("utf-16"))
    with pytest.raises(SourceError, match="UTF-16.*UTF-8"):
        list(iter_conversations("sharegpt", str(utf16)))


def test_tool_turns_are_kept_as_role_tool(tmp_path):
    rows = [{"id": "t", "messages": [{"role": "user", "content": "weather?"},
                                     {"role": "assistant", "content": "<call>weather()</call>"},
                                     {"role": "tool", "content": {"temp": 21}, "name": "weather"},
                                     {"role": "assistant", "content": "21 degrees"}]},
            chat(1, ("human", "q"), ("gpt", "call"), ("observation", "result"), ("gpt", "a")),
            chat(2, ("human", "q"), ("gpt", "call"), ("ipython", "result"), ("gpt", "a")),
            chat(3, ("human", "q"), ("gpt", "call"), ("function", "result"), ("gpt", "a"))]
    path = tmp_path / "tools.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    report = SkipReport()
    convs = list(iter_conversations("jsonl", str(path), report=report))
    assert [c.id for c in convs] == ["t", "c1", "c2", "c3"] and not report.counts
    assert convs[0].messages[2] == {"role": "tool", "content": '{"temp": 21}', "name": "weather"}
    assert all([m["role"] for m in c.messages] == ["user", "assistant", "tool", "assistant"] for c in convs)


def test_gzipped_jsonl_and_non_utf8_text(tmp_path):
    import gzip

    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in GOOD))
    assert [c.id for c in iter_conversations("auto", str(gz))] == ["c0", "c1", "c2"]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + json.dumps(GOOD[1], ensure_ascii=False).encode()
                      .replace(b"be nice", "caf\u00e9".encode("latin-1")))
    with pytest.raises(SourceError, match="latin.jsonl: not UTF-8"):
        list(iter_conversations("jsonl", str(latin)))
