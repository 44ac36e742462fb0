"""Chat templates written here to reproduce the documented behaviour of families whose real template is
not installed (the support table in docs/support_matrix.md marks them): history rewriting, reasoning
blocks, channels, a turn closer that is not the eos token. Each is paired with the special tokens it
needs and with ``generated(...)``: the text the model writes for a turn, written out by hand as the
test's oracle."""

from __future__ import annotations

import copy

# Qwen3-style: ChatML; an assistant turn after the last user turn shows its reasoning (an empty block when
# it has none and is the final turn); earlier turns lose theirs; `enable_thinking=false` puts an empty
# block in the generation prompt. Reasoning comes from `reasoning_content` or inline `<think>` text.
QWEN3_STYLE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set content = m.content -%}{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none else '' -%}
{%- if not reasoning and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}"""

# gpt-oss harmony-style: a default system message; the final assistant turn of a chat shows its analysis
# channel (`thinking`) then its final channel closed with <|return|>; history turns keep only the final
# channel, closed with <|end|>; the generation prompt stops after the role.
HARMONY_STYLE = """\
{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: medium<|end|>' -}}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- if loop.last and not add_generation_prompt -%}
{%- if m.thinking is defined and m.thinking -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}{%- endif -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}
{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}{%- endif -%}
{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"""
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"]

# DeepSeek-R1-distill-style: every assistant turn is shown without its reasoning (even the final one), and the
# generation prompt opens a think block, so the template never shows a turn after its own prompt.
R1_STYLE = """\
{{- bos_token -}}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}
{%- elif m.role == 'assistant' -%}{{- '<｜Assistant｜>' + m.content.split('</think>')[-1] + '<｜end▁of▁sentence｜>' -}}
{%- else -%}{{- m.content -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\\n' -}}{%- endif -%}"""
R1_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]

# Gemma-style: turns closed with <end_of_turn>, which is not the eos token; the assistant role is `model`.
GEMMA_STYLE = """\
{{- bos_token -}}
{%- for m in messages -%}
{%- set role = 'model' if m.role == 'assistant' else m.role -%}
{{- '<start_of_turn>' + role + '\\n' + m.content | trim + '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"""
GEMMA_TOKENS = ["<start_of_turn>", "<end_of_turn>"]


def with_template(tokenizer, template: str, special: list[str] = (), think_tags: bool = False):
    """A copy of ``tokenizer`` with ``template`` and the special tokens it needs (and ``<think>`` tags as
    ordinary added tokens, as Qwen3 and DeepSeek-R1 have them)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    if think_tags:
        tok.add_tokens(["<think>", "</think>"])
    return tok
