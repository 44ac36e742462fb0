"""Which target architectures a serving engine's release can hand a drafter the target's auxiliary hidden states
for: EAGLE-3 and DFlash draft from them, so an engine refuses those heads on any other target at load.

vLLM 0.32.0: the model classes of its ``model_executor/models`` that implement ``SupportsEagle3`` (directly or
through a base class), read from the release's source. Any other target is refused when the engine starts
(``RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested``; measured
serving an EAGLE-3 head of Gemma 3 270M, ``Gemma3ForCausalLM``, with vLLM's CPU build: docs/serving.md).

A text target vLLM refuses is exported with a warning (its SGLang folder and the evaluator still serve it). A
vision-language one is refused outright when a vLLM-read layout is asked for (``vision_export_refusal``): vLLM is
the engine the image prompts are served by here, so a folder it refuses at load is nothing to ship.
"""

from __future__ import annotations

from specheads.families import FAMILIES, family

AUX_STATE_METHODS = tuple(f.name for f in FAMILIES if f.aux_states)  # the families that draft from them
# vLLM 0.32 implements DSpark only in its V2 GPU model runner, which needs Triton; the CPU build ships none, runs the
# V1 runner and refuses the method when the engine starts (vllm/config/vllm.py):
VLLM_CPU_REFUSED = {"dspark": "Model Runner V1 does not support: dspark speculative decoding"}
VLLM_READ_LAYOUTS = ("vllm", "speculators")  # the export layouts vLLM loads (a speculators folder it converts)
VLLM_REFUSAL = "RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
VLLM_AUX_STATE_TARGETS = {
    "0.32.0": frozenset({
        "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForConditionalGeneration",
        "Cosmos3ForConditionalGeneration", "DFlash2Qwen3ForCausalLM", "DFlashLagunaForCausalLM",
        "DFlashQwen3ForCausalLM", "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
        "Eagle3DeepseekV2ForCausalLM", "Eagle3Qwen3ForCausalLM", "EagleDeepseekV3ForCausalLM", "Ernie4_5ForCausalLM",
        "Exaone4_5_ForConditionalGeneration", "Gemma4DSparkForCausalLM", "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM", "Granite4VisionLLMForCausalLM", "GraniteForCausalLM", "InternS1ProForConditionalGeneration",
        "InternS1ProMoeLLMForCausalLM", "InternS2MobiusForCausalLM", "InternS2MobiusForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration", "K2HorizonForCausalLM", "KimiK25ForConditionalGeneration",
        "LagunaForCausalLM", "LiLiCorrForCausalLM", "LightOnOCRForConditionalGeneration", "Llama4ForCausalLM",
        "Llama4ForConditionalGeneration", "LlamaForCausalLM", "LlavaForConditionalGeneration", "MiMoForCausalLM",
        "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM", "MiniCPM3ForCausalLM",
        "MiniCPMForCausalLM", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
        "MiniMaxM2ForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM", "MistralLarge3ForCausalLM",
        "MossQwen3ForCausalLM", "MuseGlimmerForCausalLM", "NemotronHForCausalLM", "OpenCUAForConditionalGeneration",
        "Phi3ForCausalLM", "PixtralForConditionalGeneration", "Plamo3ForCausalLM", "Qwen2ForCausalLM",
        "Qwen2_5_VLForConditionalGeneration", "Qwen3ASRForConditionalGeneration", "Qwen3DSparkForCausalLM",
        "Qwen3ForCausalLM", "Qwen3LLMForCausalLM", "Qwen3MoeForCausalLM", "Qwen3MoeLLMForCausalLM",
        "Qwen3NextForCausalLM", "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "SarvamMLAForCausalLM", "Step1ForCausalLM",
        "TeleChat2ForCausalLM", "TeleFLMForCausalLM",
    }),
}


def vllm_refusal(method: str, architectures: list[str] | tuple[str, ...] | None) -> str | None:
    """Why vLLM refuses ``method`` on a target of ``architectures`` (its config's), or None where it serves it (or
    the architecture is not known)."""
    if method not in AUX_STATE_METHODS or not architectures:
        return None
    refusing = [v for v, archs in VLLM_AUX_STATE_TARGETS.items() if not set(architectures) & archs]
    if not refusing:
        return None
    return (f"vLLM {', '.join(refusing)} cannot serve this head on this target: its model class "
            f"{'/'.join(architectures)} does not hand a drafter the target's auxiliary hidden states (vLLM's "
            f"SupportsEagle3 interface); the engine refuses it at load: \"{VLLM_REFUSAL}\"")


def vision_export_refusal(method: str, architectures, vision_language: bool, layouts) -> str | None:
    """The one line refusing an export of ``method`` for a vision-language target vLLM cannot hand the head its
    auxiliary states (Gemma 3's ``Gemma3ForConditionalGeneration`` in vLLM 0.32), when ``layouts`` holds one vLLM
    reads; None otherwise (a text target, an SGLang-only export, a target vLLM serves)."""
    asked = [e for e in layouts if e in VLLM_READ_LAYOUTS]
    if not vision_language or not asked or vllm_refusal(method, architectures) is None:
        return None
    versions = ", ".join(v for v, archs in VLLM_AUX_STATE_TARGETS.items() if not set(architectures) & archs)
    return (f"the target's model class {'/'.join(architectures)} does not implement vLLM {versions}'s SupportsEagle3 "
            f"interface, so vLLM refuses {family(method).title} heads on it at load: measure the head with specheads "
            "evaluate (the evaluator drafts on this target), or export engine=sglang alone")
