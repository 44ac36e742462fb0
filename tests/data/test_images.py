"""Image conversations in prepare: the formats users have, real photographs through a tiny random Qwen3-VL and
Qwen2.5-VL target's image processor and chat template, the exact assistant-only mask, unreadable images."""

import json
import logging

import pytest
import torch

from specheads.data import images as img
from specheads.data.prepare import PrepareConfig, PrepareError, load_prepared, prepare
from specheads.data.sources import SkipReport, iter_conversations, normalize
from specheads.targets import Target, load_tokenizer

from tests.data.vision_targets import save_photos, save_vision_target

pytest.importorskip("skimage", reason="scikit-image (the dev extra) holds the sample photographs")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return save_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def vl_target(request, tmp_path_factory):
    """(folder, tokenizer, VisionRenderer) of a tiny random VL target saved with its tokenizer and image processor."""
    folder = save_vision_target(tmp_path_factory.mktemp(request.param), request.param)
    tok = load_tokenizer(str(folder))
    return folder, tok, img.load_vision(str(folder), tok)


def chats(photos):
    """Two images in the first turn (differing sizes), one in a later turn, a LLaVA record, a missing file, text."""
    return [
        {"id": "parts", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{photos['astronaut']}"}},
                                         {"type": "text", "text": "Who is this, and what is that?"},
                                         {"type": "image", "image": photos["coffee"].name}]},
            {"role": "assistant", "content": "An astronaut, and a cup of coffee."},
            {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                         {"type": "image_url", "image_url": str(photos["chelsea"])}]},
            {"role": "assistant", "content": "A cat."}]},
        {"id": "llava", "image": photos["chelsea"].name, "conversations": [
            {"from": "human", "value": "<image>\nWhat animal is it?"}, {"from": "gpt", "value": "A tabby cat."}]},
        {"id": "gone", "image": "missing.jpg", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "Nothing."}]},
        {"id": "text", "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]},
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- sources


def test_each_format_gives_marked_content_and_references_in_order():
    report = SkipReport()
    openai = normalize({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x.png"}},
                                     {"type": "image", "image": "y.png"}]},
        {"role": "assistant", "content": "b"}]}, 0, report)
    assert openai.messages[0] == {"role": "user", "content": f"a{img.IMAGE_MARK}{img.IMAGE_MARK}",
                                  "images": ["x.png", "y.png"]}
    trl = normalize({"images": ["p.png", "q.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "c"}]},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "e"}]}, 1, report)
    assert [m.get("images") for m in trl.messages] == [["p.png"], None, ["q.png"], None]
    llava = normalize({"images": ["u.png", "v.png"], "conversations": [
        {"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "f"}]}, 2, report)
    assert llava.messages[0]["content"] == f"{img.IMAGE_MARK} and {img.IMAGE_MARK}?"
    no_placeholder = normalize({"image": "w.png", "conversations": [
        {"from": "human", "value": "what?"}, {"from": "gpt", "value": "g"}]}, 3, report)
    assert no_placeholder.messages[0] == {"role": "user", "content": f"{img.IMAGE_MARK}\nwhat?", "images": ["w.png"]}
    assert report.counts == {}
    # text-only records stay as they were
    assert normalize({"messages": [{"role": "user", "content": "<image> is a tag"},
                                   {"role": "assistant", "content": "h"}]}, 4, report).messages[0] == {
        "role": "user", "content": "<image> is a tag"}


@pytest.mark.parametrize("record, reason", [
    ({"images": ["a.png"], "conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]},
     img.IMAGE_COUNT),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
     img.IMAGE_COUNT),
    ({"images": ["a.png", "b.png"], "conversations": [{"from": "human", "value": "<image>"},
                                                      {"from": "gpt", "value": "x"}]}, img.IMAGE_COUNT),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]}, img.IMAGE_IN_ANSWER),
])
def test_images_that_do_not_fit_the_messages_skip_the_record_with_a_reason(record, reason):
    report = SkipReport()
    assert normalize(record, 0, report) is None and report.counts == {reason: 1}


def test_references_come_out_absolute_and_remote_ones_are_skipped(tmp_path):
    rows = [{"id": "rel", "image": "sub/a.png", "conversations": [{"from": "human", "value": "<image>q"},
                                                                  {"from": "gpt", "value": "a"}]},
            {"id": "url", "image": "https://example.org/a.png", "conversations": [
                {"from": "human", "value": "<image>q"}, {"from": "gpt", "value": "a"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    report = SkipReport()
    convs = list(iter_conversations("jsonl", str(path), report=report))
    assert [c.messages[0]["images"] for c in convs] == [[str(tmp_path / "sub" / "a.png")]]
    assert report.counts == {img.IMAGE_REMOTE: 1}
    other = list(iter_conversations("jsonl", str(path), report=SkipReport(), image_folder="/data/coco"))
    assert other[0].messages[0]["images"] == ["/data/coco/sub/a.png"]


def test_a_data_set_image_column_becomes_references_that_open(photos, tmp_path):
    import datasets
    from PIL import Image

    ds = datasets.Dataset.from_dict(
        {"image": [str(photos["coffee"])], "messages": [[{"role": "user", "content": "<image>\nWhat is it?"},
                                                        {"role": "assistant", "content": "Coffee."}]]},
        features=datasets.Features({"image": datasets.Image(), "messages": [{"role": datasets.Value("string"),
                                                                             "content": datasets.Value("string")}]}))
    ds = ds.cast_column("image", datasets.Image(decode=True))
    ds = datasets.Dataset.from_dict({"image": [Image.open(photos["coffee"])], "messages": ds["messages"]},
                                    features=ds.features)  # pixels held in the set itself, no path
    ds.save_to_disk(str(tmp_path / "set"))
    (conv,) = iter_conversations("hf", str(tmp_path / "set"))
    (ref,) = conv.messages[0]["images"]
    assert ref.startswith(f"{img.DATASET_SCHEME}://") and "row=0" in ref
    assert img.open_image(ref).size == Image.open(photos["coffee"]).size


# --------------------------------------------------------------------------- prepare through a VL target


def expected_ids(tok, vision, conv_messages, images):
    """The token ids of a chat built without specheads' renderer: the template's text with each placeholder
    repeated once per image token, tokenized whole."""
    text = tok.apply_chat_template(conv_messages, tokenize=False)
    pad = tok.convert_ids_to_tokens(vision.image_token_id)
    pieces = text.split(pad)
    assert len(pieces) == len(images) + 1
    counts = [vision.tokens_per_image(g) for g in vision.grids(images)]
    text = pieces[0] + "".join(pad * n + p for n, p in zip(counts, pieces[1:]))
    return tok(text, add_special_tokens=False)["input_ids"], counts


def test_image_chats_are_prepared_with_an_exact_assistant_mask(vl_target, photos, tmp_path, caplog):
    folder, tok, vision = vl_target
    path = write_jsonl(photos["coffee"].parent / "chats.jsonl", chats(photos))
    with caplog.at_level(logging.WARNING, logger="specheads.data.prepare"):
        meta = prepare(Target.tokenizer_only(tok, str(folder)),
                       PrepareConfig(source="jsonl", path=str(path), num_proc=1), tmp_path / "out", vision)
    ds, _ = load_prepared(tmp_path / "out")
    rows = {r["id"]: r for r in ds}
    assert sorted(rows) == ["llava", "parts", "text"]
    assert meta["skipped"] == {img.IMAGE_UNREADABLE: 1}
    lines = [r.getMessage() for r in caplog.records if "missing.jpg" in r.getMessage()]
    assert len(lines) == 1 and "gone" in lines[0] and "not found" in lines[0]
    assert meta["images"]["rows"] == 2 and meta["images"]["images"] == 4
    assert meta["images"]["model_type"] == vision.model_type and meta["images"]["settings"]["patch_size"]

    from PIL import Image

    row = rows["parts"]
    assert row["images"] == [str(photos[n]) for n in ("astronaut", "coffee", "chelsea")]  # references, not pixels
    pictures = [Image.open(p).convert("RGB") for p in row["images"]]
    assert row["image_grid_thw"] == vision.grids(pictures) and len({tuple(g) for g in row["image_grid_thw"]}) == 3
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Who is this, and what is that?"},
                                             {"type": "image"}]},
                {"role": "assistant", "content": "An astronaut, and a cup of coffee."},
                {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
                {"role": "assistant", "content": "A cat."}]
    ids, counts = expected_ids(tok, vision, template, pictures)
    assert row["input_ids"] == ids
    is_image = [t == vision.image_token_id for t in ids]
    assert sum(is_image) == sum(counts)
    assert not any(m and i for m, i in zip(row["loss_mask"], is_image))  # image tokens are never labels
    answers = tok.decode([t for t, m in zip(ids, row["loss_mask"]) if m])
    assert answers == "An astronaut, and a cup of coffee.<|im_end|>A cat.<|im_end|>"

    # the model itself accepts the row: one feature per image token (transformers checks the count)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(folder)).eval()
    pixels = vision.pixel_inputs(pictures)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=ids_t, mm_token_type_ids=(ids_t == vision.image_token_id).int(), **pixels)
    assert out.logits.shape[:2] == (1, len(ids))
    assert rows["text"]["images"] == [] and rows["llava"]["images"] == [str(photos["chelsea"])]

    # a re-run is current with the same image processing, not with another
    from dataclasses import replace

    from specheads.data.prepare import prepared_is_current

    target, cfg = Target.tokenizer_only(tok, str(folder)), PrepareConfig(source="jsonl", path=str(path), num_proc=1)
    assert prepared_is_current(tmp_path / "out", cfg, target, vision)
    assert not prepared_is_current(tmp_path / "out", cfg, target, None)
    assert not prepared_is_current(tmp_path / "out", cfg, target,
                                   replace(vision, settings={**vision.settings, "merge_size": 1}))


def test_a_cut_never_ends_inside_an_image(vl_target, photos, tmp_path):
    folder, tok, vision = vl_target
    conv = normalize({"id": "c", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image", "image": str(photos["astronaut"])}]},
        {"role": "assistant", "content": "An astronaut."},
        {"role": "user", "content": [{"type": "image", "image": str(photos["coffee"])}]},
        {"role": "assistant", "content": "Coffee."}]}, 0, SkipReport())
    from specheads.data.render import ChatRenderer, render_image_samples

    whole = render_image_samples(conv, ChatRenderer(tok), vision, 1 << 20)[0]
    second = [i for i, t in enumerate(whole.input_ids) if t == vision.image_token_id][-1]  # last image token
    (cut,) = render_image_samples(conv, ChatRenderer(tok), vision, second)
    assert cut.truncated and len(cut.images) == 1 and cut.grids == whole.grids[:1]
    assert cut.input_ids == whole.input_ids[:len(cut.input_ids)]
    assert cut.input_ids.count(vision.image_token_id) == vision.tokens_per_image(whole.grids[0])
    assert whole.input_ids[len(cut.input_ids)] != vision.image_token_id or cut.input_ids[-1] != vision.image_token_id


def test_image_rows_with_a_text_only_target_are_refused_in_one_line(smollm2_tokenizer, photos, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", chats(photos)[1:2])
    with pytest.raises(PrepareError, match="conversation llava shows images, and the target has no vision part"):
        prepare(Target.tokenizer_only(smollm2_tokenizer, "smollm2"),
                PrepareConfig(source="jsonl", path=str(path), num_proc=1), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_text_only_target_keeps_the_text_columns(smollm2_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "t", "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}]}])
    meta = prepare(Target.tokenizer_only(smollm2_tokenizer, "smollm2"),
                   PrepareConfig(source="jsonl", path=str(path), num_proc=1), tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    assert ds.column_names == ["id", "input_ids", "loss_mask", "domain"] and "images" not in meta
    assert "image_folder" not in meta["config"]


def test_a_vision_family_not_rendered_yet_prepares_text_and_refuses_images(smollm2_tokenizer, photos, tmp_path):
    from transformers import Gemma3Config

    folder = tmp_path / "gemma3"
    Gemma3Config(text_config={"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 1000},
                 vision_config={"image_size": 20, "patch_size": 5, "hidden_size": 32, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "intermediate_size": 64}).save_pretrained(folder)
    vision = img.load_vision(str(folder), smollm2_tokenizer)
    assert vision.refusal and "gemma3" in vision.refusal
    target = Target.tokenizer_only(smollm2_tokenizer, str(folder))
    text = write_jsonl(tmp_path / "t.jsonl", chats(photos)[3:])
    meta = prepare(target, PrepareConfig(source="jsonl", path=str(text), num_proc=1), tmp_path / "out", vision)
    assert meta["num_samples"] == 1 and "images" not in meta
    both = write_jsonl(tmp_path / "b.jsonl", chats(photos)[3:] + chats(photos)[1:2])
    with pytest.raises(PrepareError, match="conversation llava shows images: target .* is a gemma3 vision-language"):
        prepare(target, PrepareConfig(source="jsonl", path=str(both), num_proc=1), tmp_path / "out2", vision)


def test_worker_processes_prepare_the_same_image_rows(vl_target, photos, tmp_path):
    folder, tok, vision = vl_target
    path = write_jsonl(tmp_path / "c.jsonl", chats(photos))
    target = Target.tokenizer_only(tok, str(folder))
    for n in (1, 2):
        prepare(target, PrepareConfig(source="jsonl", path=str(path), num_proc=n, chunk_size=1,
                                      image_folder=str(photos["coffee"].parent)), tmp_path / f"o{n}", vision)
    one, two = (load_prepared(tmp_path / f"o{n}")[0].to_list() for n in (1, 2))
    assert one == two and len(one) == 3
