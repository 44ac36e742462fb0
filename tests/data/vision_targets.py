"""Tiny random vision-language targets for tests, built from transformers' own config classes and saved to a
folder with SmolLM2's tokenizer (installed offline), the family's vision tokens added and a ChatML template that
renders image parts, and the family's image processor at its default settings (the PIL backend: no torchvision). Real photographs come from scikit-image's bundled samples, resized small.

Nothing is downloaded: ``save_vision_target(tmp_path, "qwen3_vl")`` returns the folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML; a message's content is a string or a list of parts, an image part rendering as the Qwen-VL placeholder
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

FAMILIES = ("qwen3_vl", "qwen2_5_vl")


def vision_tokenizer():
    """SmolLM2's tokenizer with the Qwen-VL vision tokens and the image-aware ChatML template."""
    from specheads.targets import load_tokenizer

    tok = load_tokenizer("smollm2")
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _config(family: str, tok):
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS)}
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "qwen3_vl":
        from transformers import Qwen3VLConfig

        text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, window_size=56,
                      fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")


def image_processor(family: str):
    """The family's image processor at its default settings (Qwen3-VL: 16-pixel patches, mean and std 0.5), the
    PIL backend: transformers builds its processor classes only with torchvision, which set-up does not install."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family == "qwen3_vl":
        return Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen2VLImageProcessorPil()


def make_vision_model(family: str = "qwen3_vl", seed: int = 0, tok=None):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = _config(family, tok or vision_tokenizer())
    config._attn_implementation = "eager"
    return AutoModelForImageTextToText.from_config(config).eval().requires_grad_(False)


def save_vision_target(folder: str | Path, family: str = "qwen3_vl", seed: int = 0) -> Path:
    """A tiny random ``family`` target saved with its tokenizer (and chat template) and image processor."""
    folder = Path(folder)
    tok = vision_tokenizer()
    make_vision_model(family, seed, tok).save_pretrained(folder)
    image_processor(family).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


SAMPLES = {"astronaut": (96, 96), "coffee": (80, 120), "chelsea": (64, 160)}  # (height, width) after resizing


def photo(name: str, size: tuple[int, int] | None = None):
    """A scikit-image sample photograph (bundled in its wheel) as an RGB PIL image of ``size`` (h, w)."""
    from PIL import Image
    from skimage import data

    h, w = size or SAMPLES[name]
    return Image.fromarray(getattr(data, name)()).convert("RGB").resize((w, h), Image.BICUBIC)


def save_photos(folder: str | Path, names=tuple(SAMPLES)) -> dict[str, Path]:
    """The sample photographs written as JPEG files in ``folder``: {name: path}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        out[name] = folder / f"{name}.jpg"
        photo(name).save(out[name], quality=90)
    return out


def image_chats(photos: dict[str, Path]) -> list[dict]:
    """Three conversations over ``save_photos``' files: two images in one turn and one in a later turn (OpenAI-style
    parts), one ShareGPT4V ``<image>`` chat, and a text chat."""
    return [
        {"id": "two", "messages": [
            {"role": "user", "content": [{"type": "image", "image": str(photos["astronaut"])},
                                         {"type": "text", "text": "and"},
                                         {"type": "image", "image": str(photos["coffee"])}]},
            {"role": "assistant", "content": "An astronaut and a cup of coffee."},
            {"role": "user", "content": [{"type": "text", "text": "This?"},
                                         {"type": "image", "image": str(photos["chelsea"])}]},
            {"role": "assistant", "content": "A cat, sitting."}]},
        {"id": "one", "image": str(photos["chelsea"]), "conversations": [
            {"from": "human", "value": "<image>\nWhat animal is this?"}, {"from": "gpt", "value": "A tabby cat."}]},
        {"id": "text", "messages": [{"role": "user", "content": "Hello there"},
                                    {"role": "assistant", "content": "Hi! How can I help?"}]},
    ]


def prepare_image_chats(root: Path, folder: Path) -> Path:
    """``image_chats`` over photos saved in ``root``, written as JSONL and prepared for the VL target in ``folder``
    (its processor and template); returns the prepared folder, ``root / "prepared"``."""
    import json

    from specheads.data import images as img
    from specheads.data.prepare import PrepareConfig, prepare
    from specheads.targets import Target, load_tokenizer

    rows = image_chats(save_photos(root / "photos"))
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(str(folder))
    prepare(Target.tokenizer_only(tok, str(folder)),
            PrepareConfig(source="jsonl", path=str(root / "c.jsonl"), num_proc=1), root / "prepared",
            img.load_vision(str(folder), tok))
    return root / "prepared"
