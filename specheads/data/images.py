"""Image conversations: where a chat's images are, how they are read, and how they become tokens.

Sources (``specheads.data.sources``) hand every image-holding message over in one form, whatever the data set
wrote: its ``content`` a string in which ``IMAGE_MARK`` stands where each image sits, and ``images`` the
references of those images in the same order. The formats read:

- OpenAI-style content parts: ``{"type": "image_url", "image_url": {"url": "file:///a.jpg"}}`` (or the URL as
  a string), ``{"type": "image", "image": "a.jpg"}``, ``{"type": "text", "text": ...}``; a bare
  ``{"type": "image"}`` takes the record's next image (its ``image``/``images`` field: TRL's layout);
- ShareGPT4V/LLaVA-style ``<image>`` placeholders in the text with the record's ``image`` (a path) or
  ``images`` (paths); a record with images and no placeholder gets them at the start of its first user turn.

A reference is a local path (absolute once prepared; a relative one is read under ``data.image_folder``, else
beside the data file), a ``file://`` URL, or an image of a data set's image column (``DATASET_SCHEME``: the
set, split, row, column and place). Remote URLs are not fetched. The prepared store keeps references, never
pixels, and each image's patch grid (``image_grid_thw``), so collection recomputes the pixel inputs and checks
that they are the ones prepared.

Rendering (``VisionRenderer``): the chat template renders each image as its placeholder token (Qwen-VL:
``<|image_pad|>`` between ``<|vision_start|>``/``<|vision_end|>``); the target's image processor gives the image's
grid, and the placeholder becomes the ``t*h*w / merge_size**2`` tokens the model fills with vision features.
Image tokens are never labels. A sample cut at ``max_length`` never ends inside an image: it ends before it.

Collection (``image_reader``, ``with_pixels``): each batch's images are read again from their references and
processed by the same image processor; a grid that differs from the prepared one is refused, naming the image.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qs, quote, unquote, urlencode, urlparse

from specheads.data.store import StoreMismatchError
from specheads.errors import UserError
from specheads.targets import resolve_target_path

log = logging.getLogger(__name__)

IMAGE_MARK = "\ue00b"  # a private-use character: where an image sits in a message's content
IMAGES = "images"  # a message's image references, in the order of its marks
PLACEHOLDER = "<image>"  # ShareGPT4V / LLaVA
DATASET_SCHEME = "hf-dataset"  # hf-dataset://<set>?split=&row=&column=&item=
IMAGE_UNREADABLE = "image missing or unreadable"
IMAGE_COUNT = "image placeholders and images differ in number"
IMAGE_REMOTE = "image given as a remote or inline URL (not fetched)"
IMAGE_IN_ANSWER = "image in an assistant turn"
# model types whose image placeholder becomes grid.prod() / merge_size**2 copies of one token (M-RoPE targets)
GRID_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


class ImageError(UserError, ValueError):
    """An image a conversation names cannot be read (the message names the file)."""


class RecordImageError(ValueError):
    """A record's images do not fit its messages (``reason`` is the skip reason it is counted under)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# --------------------------------------------------------------------------- reading records


def record_images(record: dict) -> list:
    """The record-level images of a ShareGPT4V/LLaVA/TRL record (``image``: one, ``images``: several)."""
    for key in ("images", "image"):
        value = record.get(key)
        if value is None:
            continue
        return list(value) if isinstance(value, (list, tuple)) else [value]
    return []


def message_content(content: Any, pending: list, role: str) -> tuple[Any, list]:
    """(text with ``IMAGE_MARK`` per image, the images' references) of one message's content: content parts, or a
    string whose ``<image>`` placeholders take the record's ``pending`` images in turn (consumed from it)."""
    refs: list = []
    known = ("text", "image", "image_url", "input_image")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in known for p in content):
        pieces = []
        for part in content:
            kind = part["type"]
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind in ("image", "image_url", "input_image"):
                ref = _part_ref(part, kind)
                if ref is None:
                    if not pending:
                        raise RecordImageError(IMAGE_COUNT, "an image part with no image and no record image left")
                    ref = pending.pop(0)
                refs.append(ref)
                pieces.append(IMAGE_MARK)
        text = "".join(pieces)
    elif isinstance(content, str) and pending and PLACEHOLDER in content:
        n = content.count(PLACEHOLDER)
        if n > len(pending):
            raise RecordImageError(IMAGE_COUNT, f"{n} {PLACEHOLDER} placeholders, {len(pending)} images left")
        refs = [pending.pop(0) for _ in range(n)]
        text = content.replace(PLACEHOLDER, IMAGE_MARK)
    else:
        return content, []
    if refs and role == "assistant":
        raise RecordImageError(IMAGE_IN_ANSWER, "an assistant turn holds an image")
    return text, refs


def _part_ref(part: dict, kind: str):
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    return value if value not in (None, "") else None


def place_leftover(messages: list[dict], pending: list) -> None:
    """Images a record names but no placeholder places go at the start of its first user turn (LLaVA's rule)."""
    if not pending:
        return
    first = next(m for m in messages if m["role"] == "user")
    first["content"] = IMAGE_MARK * len(pending) + "\n" + first["content"]
    first[IMAGES] = list(pending) + first.get(IMAGES, [])
    pending.clear()


def has_images(messages: Sequence[dict]) -> bool:
    return any(m.get(IMAGES) for m in messages)


def conversation_images(messages: Sequence[dict]) -> list:
    """Every image reference of a chat, in the order the chat shows them."""
    return [ref for m in messages for ref in m.get(IMAGES, ())]


def template_content(content: str) -> list[dict]:
    """A marked content string as the content parts chat templates render: images and text in order."""
    parts: list[dict] = []
    for i, text in enumerate(content.split(IMAGE_MARK)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


# --------------------------------------------------------------------------- references


def dataset_ref(dataset: str, split: str, row: int, column: str, item: int = 0) -> str:
    """The reference of an image held in a data set's image column."""
    query = urlencode({"split": split, "row": row, "column": column, "item": item})
    return f"{DATASET_SCHEME}://{quote(str(dataset), safe='/:')}?{query}"


def resolve_ref(ref: Any, root: str | Path | None) -> str:
    """An absolute reference: a local path (``file://`` URLs read as paths; a relative path under ``root``) or a
    data set image's reference as it is. A remote or inline URL raises ``ImageError``."""
    if not isinstance(ref, str) or not ref:
        raise ImageError(f"image reference {ref!r} is not a path")
    if ref.startswith(f"{DATASET_SCHEME}://"):
        return ref
    if ref.startswith("file://"):
        ref = unquote(urlparse(ref).path)
    elif "://" in ref or ref.startswith("data:"):
        raise ImageError(f"{ref[:60]}: remote and inline images are not fetched; save them as files and give paths")
    path = Path(ref).expanduser()
    if not path.is_absolute() and root is not None:
        path = Path(root).expanduser() / path
    return str(path.resolve())


def open_image(ref: str):
    """The image a resolved reference names, as an RGB PIL image; ``ImageError`` naming it when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        if ref.startswith(f"{DATASET_SCHEME}://"):
            image = _dataset_image(ref)
        else:
            with Image.open(ref) as f:
                image = f.convert("RGB")
        image.load()
        return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, KeyError, IndexError) as e:
        why = "not found" if isinstance(e, FileNotFoundError) else f"unreadable ({type(e).__name__}: {e})"
        raise ImageError(f"{ref}: {why}") from None


def _dataset_image(ref: str):
    import datasets

    url = urlparse(ref)
    q = {k: v[0] for k, v in parse_qs(url.query).items()}
    name = unquote(url.netloc + url.path)
    ds = datasets.load_from_disk(name) if Path(name).exists() else datasets.load_dataset(name, split=q["split"])
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[q["split"]]
    value = ds[int(q["row"])][q["column"]]
    value = value[int(q["item"])] if isinstance(value, (list, tuple)) else value
    if isinstance(value, dict):  # an undecoded Image feature
        import io

        from PIL import Image

        return Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else Image.open(value["path"])
    return value


# --------------------------------------------------------------------------- the target's image processing


@dataclass
class VisionRenderer:
    """A vision-language target's image processing: its image processor (``AutoImageProcessor``) and the
    placeholder token its chat template renders per image (``image_token_id``), which becomes
    ``tokens_per_image`` copies. ``model_type``: the target's (``GRID_FAMILIES``)."""

    image_processor: Any
    image_token_id: int
    model_type: str
    settings: dict = field(default_factory=dict)
    refusal: str | None = None  # a vision-language family prepare renders no images for yet: why, in one line

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 1) or 1)

    def grids(self, images: list) -> list[list[int]]:
        """(t, h, w) patch grid of each image."""
        if not images:
            return []
        out = self.image_processor(images=images, return_tensors="np")
        return [[int(x) for x in row] for row in out["image_grid_thw"]]

    def pixel_inputs(self, images: list) -> dict:
        """The model's pixel inputs of ``images`` in order: ``pixel_values`` (patches, C*T*P*P) and
        ``image_grid_thw`` (n, 3), torch tensors."""
        import torch

        out = self.image_processor(images=images, return_tensors="np")
        return {"pixel_values": torch.as_tensor(out["pixel_values"]),
                "image_grid_thw": torch.as_tensor(out["image_grid_thw"]).long()}

    def tokens_per_image(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t * h * w) // self.merge_size ** 2

    def describe(self) -> dict:
        """What the prepared store records to recompute the pixel inputs."""
        return {"model_type": self.model_type, "image_token_id": self.image_token_id,
                "image_processor": type(self.image_processor).__name__, "settings": self.settings}


def vision_config(config) -> Any:
    """The vision sub-config of a target config (None for a text-only target)."""
    return getattr(config, "vision_config", None)


def load_vision(name_or_path: str, tokenizer) -> VisionRenderer | None:
    """The ``VisionRenderer`` of a target folder or hub id whose config has a vision part (its image processor:
    ``AutoImageProcessor``), None for a text-only target. A vision-language family whose images are not rendered
    yet gets one whose ``refusal`` says so: its text conversations prepare as before, an image one is refused."""
    from transformers import AutoConfig, AutoImageProcessor

    path = resolve_target_path(name_or_path)
    config = None
    for local in (True, False):  # the cached config first: no network where the machine has it
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=local)
            break
        except Exception:  # noqa: BLE001 - no readable config: a text-only target as far as images go
            continue
    if config is None or vision_config(config) is None:
        return None
    if config.model_type not in GRID_FAMILIES:
        return VisionRenderer(None, -1, config.model_type, refusal=(
            f"target '{name_or_path}' is a {config.model_type} vision-language model; image conversations are "
            f"prepared for {', '.join(GRID_FAMILIES)} targets so far"))
    return vision_renderer(config, AutoImageProcessor.from_pretrained(path), tokenizer)


def vision_renderer(config, image_processor, tokenizer) -> VisionRenderer:
    """A ``VisionRenderer`` from a target's config, image processor and tokenizer."""
    token_id = getattr(config, "image_token_id", None)
    if token_id is None:
        token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    settings = json.loads(image_processor.to_json_string()) if hasattr(image_processor, "to_json_string") else {}
    return VisionRenderer(image_processor, int(token_id), config.model_type, settings)


# --------------------------------------------------------------------------- samples


@dataclass
class ImageSample:
    """One prepared row of an image chat: token ids and loss mask with every image's tokens in place, the
    images' references and grids in order, and whether it was cut at ``max_length``."""

    input_ids: list[int]
    loss_mask: list[int]
    images: list[str]
    grids: list[list[int]]
    truncated: bool
    suffix: str = ""


def expand_images(ids: list[int], mask: list[int], grids: list[list[int]], vision: VisionRenderer,
                  max_length: int) -> tuple[list[int], list[int], int, bool]:
    """Each placeholder token of ``ids`` replaced by its image's tokens (mask 0), cut to ``max_length`` before any
    image that would not fit whole. Returns (ids, mask, images kept, truncated); the chat's i-th placeholder is
    its i-th image."""
    out_ids: list[int] = []
    out_mask: list[int] = []
    image = 0
    for tok, m in zip(ids, mask):
        if tok == vision.image_token_id:
            if m:
                raise ValueError("an image token is masked as a label")
            n = vision.tokens_per_image(grids[image])
            if len(out_ids) + n > max_length:
                return out_ids, out_mask, image, True
            out_ids += [tok] * n
            out_mask += [0] * n
            image += 1
            continue
        if len(out_ids) >= max_length:
            return out_ids, out_mask, image, True
        out_ids.append(tok)
        out_mask.append(m)
    return out_ids, out_mask, image, False


# --------------------------------------------------------------------------- collection


def image_reader(target, dataset, vision=None) -> VisionRenderer | None:
    """The image processing that reads a prepared set's images (None for a set without an image column); prepared
    image rows with a target that reads no images are refused in one line."""
    if "images" not in dataset.column_names:
        return vision
    if not getattr(target, "vision_language", False):
        raise StoreMismatchError(f"the prepared rows hold images and target '{target.name}' has no vision part; "
                                 "collect with the vision-language target they were prepared for")
    if vision is None:
        vision = load_vision(target.name, target.tokenizer)
    return vision


def with_pixels(batch: dict[str, Any], vision: VisionRenderer) -> dict[str, Any]:
    """A collated batch with its rows' images read and processed (``images.VisionRenderer``): ``pixel_values`` and
    ``image_grid_thw`` (n_images, 3) of every row's images in row order, in place of their references; a batch
    without an image loses the references only. An image whose grid differs from the one prepared (the file
    changed since, or another image processor) is refused, naming it."""
    refs = [r for row in batch.pop("images", []) for r in row]
    grids = [g for row in batch.pop("image_grid_thw", []) for g in row]
    if not refs:
        return batch
    pixels = vision.pixel_inputs([open_image(r) for r in refs])
    got = pixels["image_grid_thw"].tolist()
    for ref, want, have in zip(refs, grids, got):
        if list(want) != have:
            raise StoreMismatchError(f"{ref}: the image processor gives patch grid {have}, the prepared row {want} "
                                     "(the image or the target's image processor changed since prepare); prepare "
                                     "the data again")
    return {**batch, **pixels}
