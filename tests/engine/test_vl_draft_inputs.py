"""What vLLM's EAGLE-3 draft of a vision-language target reads, checked against the installed engine's own code (one
engine python, no model load: a few seconds; runs wherever the engine is installed):

* its M-RoPE is the one the draft trains with: the draft config's ``rope_parameters`` (``mrope_section``,
  ``mrope_interleaved``) handed to vLLM's ``get_rope`` rotate queries and keys at 3-D positions exactly as
  ``specheads.models.mrope`` does (Qwen2.5-VL's sections in order, Qwen3-VL's interleaved; the tiny test targets'
  settings and the released 7B/8B models');
* the class it loads the draft as (``LlamaForCausalLMEagle3``, the export's, and ``Eagle3Qwen2_5vlForCausalLM`` /
  ``Eagle3Qwen3vlForCausalLM`` alike) takes no multimodal embeddings, so its proposer hands it token ids and the
  draft embeds the image token at image slots, as training feeds it (docs/train.md). An engine whose draft starts
  taking the vision features there fails this test: training must then feed those.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from specheads.models.eagle3 import Eagle3Config
from specheads.models.layers import apply_rotary_pos_emb
from specheads.models.mrope import MRotaryEmbedding, rotary_embedding
from tests.engine.conftest import _engine

pytestmark = pytest.mark.engine_ci

# (head_dim, mrope_section, interleaved): tiny Qwen3-VL / Qwen2.5-VL test targets, Qwen3-VL-8B, Qwen2.5-VL-7B
CASES = [(8, [2, 1, 1], True), (8, [1, 1, 2], False), (128, [24, 20, 20], True), (128, [16, 24, 24], False)]

ENGINE_SIDE = """
import json, sys, torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
out = []
for case in json.loads(sys.stdin.read()):
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(case["head_dim"], 4096, True, case["rope_parameters"], torch.float32)
    q, k = rope.forward_native(torch.tensor(case["positions"]), torch.tensor(case["q"]), torch.tensor(case["k"]))
    out.append({"class": type(rope).__name__, "q": q.tolist(), "k": k.tolist()})
from vllm.model_executor.models import ModelRegistry, supports_multimodal_embeddings
archs = ["LlamaForCausalLMEagle3", "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM"]
classes = {a: ModelRegistry._try_load_model_cls(a) for a in archs}
draft = {"classes": sorted({c.__name__ for c in classes.values()}),
         "takes_vision_features": any(supports_multimodal_embeddings(c) for c in classes.values())}
print(json.dumps({"rope": out, "draft": draft}))
"""


def _ours(config: Eagle3Config, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """(N, heads * D) queries and keys rotated by the draft's rotary embedding at (3, N) positions."""
    rope = rotary_embedding(config)
    assert isinstance(rope, MRotaryEmbedding)
    N, D = q.shape[0], config.head_dim
    cos, sin = rope(q, positions.T[None])
    q, k = apply_rotary_pos_emb(q.view(1, N, -1, D).transpose(1, 2), k.view(1, N, -1, D).transpose(1, 2), cos, sin)
    return q.transpose(1, 2).reshape(N, -1), k.transpose(1, 2).reshape(N, -1)


def test_the_draft_reads_what_vllm_hands_it():
    engine = _engine()
    g = torch.Generator().manual_seed(0)
    cases, ours = [], []
    for head_dim, section, interleaved in CASES:
        config = Eagle3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                  "mrope_section": section,
                                                                  "mrope_interleaved": interleaved})
        config = Eagle3Config.from_dict(json.loads(config.to_json_string()))  # as the exported config reads back
        positions = torch.randint(0, 3000, (3, 13), generator=g)
        q, k = torch.randn(13, 4 * head_dim, generator=g), torch.randn(13, 2 * head_dim, generator=g)
        cases.append({"head_dim": head_dim, "rope_parameters": config.rope_parameters, "positions": positions.tolist(),
                      "q": q.tolist(), "k": k.tolist()})
        ours.append(_ours(config, positions, q, k))
    proc = subprocess.run([engine.python, "-c", ENGINE_SIDE], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reply = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reply["draft"] == {"classes": ["Eagle3LlamaForCausalLM"], "takes_vision_features": False}
    for (q, k), got, case in zip(ours, reply["rope"], CASES):
        assert got["class"] == "MRotaryEmbedding", case
        torch.testing.assert_close(q, torch.tensor(got["q"]), rtol=1e-5, atol=1e-5, msg=str(case))
        torch.testing.assert_close(k, torch.tensor(got["k"]), rtol=1e-5, atol=1e-5, msg=str(case))
