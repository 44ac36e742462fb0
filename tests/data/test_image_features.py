"""Collection through a vision-language target: the stored states of every position (image positions included)
are the states of a plain full forward of the VL model on the same row, the vision encoder runs once per image,
and the store keeps the 3-D M-RoPE positions the language model ran at."""

import pytest
import torch

from specheads.data import images as img
from specheads.data.features import CollectOptions, FeatureDataset, collect_hidden_states, spec_for_method
from specheads.data.prepare import load_prepared
from specheads.data.store import StoreMismatchError
from specheads.targets import load_target

from tests.data.vision_targets import prepare_image_chats, save_vision_target

pytest.importorskip("skimage", reason="scikit-image (the dev extra) holds the sample photographs")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def prepared(request, tmp_path_factory):
    """(target folder, prepared folder) of image chats (two images in a turn, one later, differing sizes) and a
    text chat, prepared for a tiny random VL target."""
    root = tmp_path_factory.mktemp(request.param)
    folder = save_vision_target(root / "target", request.param)
    prepare_image_chats(root, folder)
    return folder, root / "prepared"


def plain_forward(model, vision, row):
    """The VL model's own full forward (with its LM head) on one prepared row: its output (hidden states, logits),
    the positions its language model ran at, and the input of each decoder layer."""
    from PIL import Image

    ids = torch.tensor([row["input_ids"]])
    kwargs = {}
    if row["images"]:
        kwargs = {**vision.pixel_inputs([Image.open(p).convert("RGB") for p in row["images"]]),
                  "mm_token_type_ids": (ids == vision.image_token_id).int()}
    seen = {}

    def keep_positions(module, args, kw):
        seen["positions"] = kw.get("position_ids")

    hooks = [model.model.language_model.register_forward_pre_hook(keep_positions, with_kwargs=True)]
    for i, layer in enumerate(model.model.language_model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(i, (a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, **kwargs)
    for h in hooks:
        h.remove()
    return out, seen["positions"], [seen[i][0] for i in range(len(model.model.language_model.layers))]


def test_collected_states_are_the_vl_models_full_forward(prepared, tmp_path):
    folder, prepared_dir = prepared
    dataset, _ = load_prepared(prepared_dir)
    target = load_target(str(folder))
    assert target.vision_language and target.num_layers == 4 and target.hidden_size == 32
    vision = img.load_vision(str(folder), target.tokenizer)
    patches = []  # rows the vision encoder embeds per call: each image's patches once
    hook = target.model.model.visual.patch_embed.register_forward_hook(lambda m, a, o: patches.append(a[0].shape[0]))
    spec = spec_for_method("eagle3", target.num_layers)
    summary = collect_hidden_states(target, dataset, spec, tmp_path / "store",
                                    CollectOptions(dtype="float32", batch_tokens=4096, estimate_time=False,
                                                   progress=False))
    hook.remove()
    all_grids = [g for row in dataset["image_grid_thw"] for g in row]
    assert sum(patches) == sum(t * h * w for t, h, w in all_grids)  # 4 images, each encoded once
    assert summary["manifest"]["positions"]
    store = FeatureDataset(tmp_path / "store")
    rows = {r["id"]: r for r in dataset}
    for item in store:
        row = rows[item["id"]]
        out, positions, layer_inputs = plain_forward(target.model, vision, row)
        torch.testing.assert_close(item["hidden_last"], out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(target.logits(item["hidden_last"][None])[0], out.logits[0], rtol=1e-4, atol=1e-4)
        aux = item["hidden_aux"].view(len(row["input_ids"]), 3, -1)
        image = torch.tensor(row["input_ids"]) == vision.image_token_id
        deepstack = len(getattr(target.config.vision_config, "deepstack_visual_indexes", None) or ())
        for k, layer in enumerate(spec.aux_layers):
            # aux layer i is the input of decoder layer i, as vLLM captures it: after Qwen3-VL's deepstack adds
            # vision features to the image positions of the first layers' outputs (HF's hidden_states[i] is before)
            torch.testing.assert_close(aux[:, k], layer_inputs[layer], rtol=1e-5, atol=1e-5)
            same = ~image if layer <= deepstack else torch.ones_like(image)
            torch.testing.assert_close(aux[same, k], out.hidden_states[layer][0][same], rtol=1e-5, atol=1e-5)
        want = positions[-3:, 0].T if positions is not None else torch.arange(len(row["input_ids"]))[:, None].expand(-1, 3)
        assert torch.equal(item["positions"], want)
        if row["images"]:  # image rows run at 3-D positions: height and width differ from time inside an image
            assert not torch.equal(item["positions"][:, 1], item["positions"][:, 0])
    # EAGLE-3's trainer reads image rows (tests/methods/test_eagle3_images.py); a method that does not train on them
    # as the engine drafts there refuses the store
    assert summary["manifest"]["source"]["image_rows"] == 2
    assert len(FeatureDataset(tmp_path / "store", spec=spec, target=target)) == 3
    with pytest.raises(StoreMismatchError, match="holds 2 image rows of a vision-language target, and this method"):
        FeatureDataset(tmp_path / "store", spec=spec_for_method("eagle1", target.num_layers), target=target)


def test_image_rows_with_a_text_only_target_are_refused(prepared, tmp_path, tiny_target):
    _, prepared_dir = prepared
    dataset, _ = load_prepared(prepared_dir)
    with pytest.raises(StoreMismatchError, match="hold images and target 'tiny-llama' has no vision part"):
        collect_hidden_states(tiny_target, dataset, spec_for_method("eagle1", tiny_target.num_layers), tmp_path / "s",
                              CollectOptions(dtype="float32", estimate_time=False, progress=False))


def test_the_collect_recipe_takes_image_rows_through_the_target_and_refuses_vllm(prepared, tmp_path):
    import importlib

    from specheads.errors import ConfigError
    from specheads.overrides import compose

    recipe = importlib.import_module("specheads.recipes.collect_hidden_states")
    folder, prepared_dir = prepared
    common = ["target.device=cpu", "target.dtype=float32", f"target.name_or_path={folder}",
              f"prepared_dir={prepared_dir}"]
    with pytest.raises(ConfigError, match="holds image rows, which engine=vllm does not collect yet: use engine=hf"):
        recipe.collect(compose("collect_hidden_states", [*common, "engine=vllm", f"output_dir={tmp_path / 'v'}"],
                               "collect"))
    assert not (tmp_path / "v").exists()
    recipe.collect(compose("collect_hidden_states", [*common, f"output_dir={tmp_path / 's'}"], "collect"))
    store = FeatureDataset(tmp_path / "s")
    assert len(store) == 3 and store.manifest["positions"] and store.manifest["source"]["engine"] == "hf"
    assert all(item["positions"].shape == (len(item["input_ids"]), 3) for item in store)


def test_online_features_of_image_rows_are_refused_not_computed_blind(prepared):
    from specheads.data.features import TokenDataset, collate_features, compute_features
    from specheads.errors import ConfigError

    folder, prepared_dir = prepared
    dataset, _ = load_prepared(prepared_dir)
    target = load_target(str(folder))
    batch = collate_features(TokenDataset(dataset).rows(range(len(dataset))))  # references, no pixels read
    with pytest.raises(ConfigError, match="online features of image rows are not computed yet"):
        compute_features(target, batch, spec_for_method("eagle1", target.num_layers))
    with pytest.raises(ValueError, match="image tokens and no pixel inputs"):
        target.forward_features(batch["input_ids"], batch["attention_mask"])
