"""Target models: where their files come from (``files``), their tokenizer and chat template
(``tokenizers``, ``chat_templates``), the ``Target`` wrapper that reads their hidden states (``model``), how
they are split over processes and devices (``parallel``), and how every stage loads them (``loading``).
The names below are the package's API: ``from specheads.targets import load_target, Target``.

Layer-index convention (the one place it is defined; everything else refers here)
-------------------------------------------------------------------------------
A target with N decoder layers has a residual stream. ``aux layer i`` (0 <= i < N) is the
*input* of decoder layer ``i`` (counting from 0), i.e. Hugging Face's ``hidden_states[i]``
from ``output_hidden_states=True`` (``hidden_states[0]`` is the embedding output).
vLLM and vLLM-speculators count the same way; SpecForge counts layer *outputs*
(1, N/2-1, N-4), which are the same tensors as our (2, N/2, N-3).

The ``last`` hidden state is the output of the final norm (post-norm), i.e. Hugging Face's
``hidden_states[N]`` for Llama-family models. This is what vLLM and SGLang hand an EAGLE-1 or
Medusa drafter at serving time (their ``LlamaModel.forward`` returns the normed state), and the
target's logits are exactly ``lm_head(last)``, soft-capped where the family caps them (Gemma-2's
``final_logit_softcapping``: ``output_logits``).

EAGLE-3's default fusion layers are ``default_eagle3_layers(N) == (2, N // 2, N - 3)``.

A split target (``load_target(parallel=...)``) keeps this convention: ``tp`` shards every decoder layer
over a tensor-parallel group and its hidden states come out whole (replicated) on every rank of the
group; ``device_map`` spreads the layers over this process's devices and the hidden states are
gathered onto the input's device. See ``ParallelLayout`` for how data is then shared out.
"""

from specheads.targets.files import (EMBEDDED_GGUF, EMBEDDED_TARGET, AssetMissingError, TargetLoadError,
                                     TargetNotFoundError, asset_path, cache_root, check_target_source, convert_gguf,
                                     embedded_gguf, resolve_target_path)
from specheads.targets.loading import load_target, load_tokenizer
from specheads.targets.model import (TARGET_CHUNK, RawEmbedding, Target, TargetFeatures, UnsupportedTargetError,
                                     capture_layer_inputs, check_aux_layers, config_hash, default_eagle3_layers,
                                     eos_token_ids, logit_softcap, model_family, output_logits,
                                     recurrent_layer_types, target_argmax, text_decoder)
from specheads.targets.parallel import (PARALLEL_MODES, ParallelLayout, data_parallel_share, device_map_devices,
                                        end_process_group, launch_rank_world, parallel_layout)
from specheads.targets.tokenizers import own_tokenizer, tokenizer_fingerprint

__all__ = [
    "EMBEDDED_GGUF", "EMBEDDED_TARGET", "PARALLEL_MODES", "TARGET_CHUNK", "AssetMissingError", "ParallelLayout",
    "RawEmbedding", "Target", "TargetFeatures", "TargetLoadError", "TargetNotFoundError", "UnsupportedTargetError", "asset_path",
    "cache_root", "capture_layer_inputs", "check_aux_layers", "check_target_source", "config_hash", "convert_gguf",
    "data_parallel_share", "default_eagle3_layers", "device_map_devices", "embedded_gguf", "end_process_group",
    "eos_token_ids", "launch_rank_world", "load_target", "load_tokenizer", "logit_softcap", "model_family",
    "output_logits", "own_tokenizer", "parallel_layout", "recurrent_layer_types", "resolve_target_path",
    "target_argmax", "text_decoder", "tokenizer_fingerprint",
]
