import pytest

from specheads.data.render import TemplateError, render, turn_token_groups
from specheads.data.sources import Conversation

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue.\n\nOr  green, with  spaces."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Red — 🍎 and \"quotes\"."}],
    [{"role": "user", "content": "def f(x):\n    return x"}, {"role": "assistant", "content": "```python\nprint(1)\n```"},
     {"role": "user", "content": "ok"}, {"role": "assistant", "content": " leading space"}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_mask_decodes_to_each_assistant_turn(smollm2_tokenizer, messages):
    tok = smollm2_tokenizer
    r = render(Conversation("t", messages), tok, max_length=4096)
    assert not r.truncated and len(r.input_ids) == len(r.loss_mask)
    got = [tok.decode(g) for g in turn_token_groups(r)]
    want = [m["content"] + tok.eos_token for m in messages if m["role"] == "assistant"]
    assert got == want
    # The rendered ids are the template's own tokenization.
    assert r.input_ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def test_long_conversation_is_cut_to_max_length(smollm2_tokenizer):
    msgs = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "answer " * 50}]
    r = render(Conversation("long", msgs), smollm2_tokenizer, max_length=90)
    assert r.truncated and len(r.input_ids) == 90 and sum(r.loss_mask) > 0


def test_tokenizer_without_template_is_refused(smollm2_tokenizer):
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        render(Conversation("x", CHATS[0]), tok, 100)


# --------------------------------------------------------------------------- tool turns

TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "<tool_call>weather(city='Paris')</tool_call>"},
             {"role": "tool", "content": '{"temp": 21}'},
             {"role": "assistant", "content": "It is 21 degrees."}]
# A template that renders user/assistant only and silently drops other roles (many older templates).
DROPS_TOOLS = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}<|im_start|>{{ m['role'] }}\n"
               "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A template that refuses them (Llama-2 / Mistral style raise_exception).
REFUSES_TOOLS = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
                 "{{ raise_exception('Only user, assistant and system roles are supported') }}{% endif %}"
                 "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(tok, template):
    import copy

    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


def test_tool_turns_kept_when_the_template_renders_them(smollm2_tokenizer):
    tok = smollm2_tokenizer  # ChatML: renders any role
    r = render(Conversation("t", TOOL_CHAT), tok, max_length=4096)
    assert [tok.decode(g) for g in turn_token_groups(r)] == [TOOL_CHAT[1]["content"] + tok.eos_token,
                                                             TOOL_CHAT[3]["content"] + tok.eos_token]
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in tok.decode(r.input_ids)  # rendered, not masked


@pytest.mark.parametrize("template, match", [(DROPS_TOOLS, "does not render tool turns"),
                                             (REFUSES_TOOLS, "refuses tool turns")])
def test_tool_turns_refused_by_name_when_the_template_cannot_render_them(smollm2_tokenizer, template, match):
    from specheads.data.render import ToolTurnError

    tok = with_template(smollm2_tokenizer, template)
    with pytest.raises(ToolTurnError, match=match):
        render(Conversation("t", TOOL_CHAT), tok, max_length=4096)
    # the same template still renders chats without tool turns
    r = render(Conversation("c", CHATS[0]), tok, max_length=4096)
    assert [tok.decode(g) for g in turn_token_groups(r)] == [CHATS[0][1]["content"] + tok.eos_token]


# --------------------------------------------------------------------------- regenerated turns: exact ids


def test_regenerated_turns_are_placed_as_their_token_ids(smollm2_tokenizer):
    from specheads.data.render import prompt_ids

    tok = smollm2_tokenizer
    he, llo = tok.convert_tokens_to_ids(["he", "llo"])
    assert tok(tok.decode([he, llo]), add_special_tokens=False)["input_ids"] != [he, llo]  # re-tokenizing merges them
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": tok.decode([he, llo]), "token_ids": [he, llo]},
            {"role": "user", "content": "Again"},
            {"role": "assistant", "content": tok.decode([llo, he]), "token_ids": [llo, he]}]
    r = render(Conversation("x", msgs), tok, max_length=4096)
    assert turn_token_groups(r) == [[he, llo, tok.eos_token_id], [llo, he, tok.eos_token_id]]
    # the prompt of the second turn (built the same way) is a prefix of the chat
    prompt = prompt_ids(msgs[:3], tok)
    assert r.input_ids[:len(prompt)] == prompt and r.input_ids[len(prompt):len(prompt) + 2] == [llo, he]
    assert prompt[:len(prompt_ids(msgs[:1], tok))] == \
        tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    # the text around the turns is the template's
    assert tok.decode(r.input_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_a_cut_answer_ends_the_chat_without_an_end_of_turn_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    he, llo = tok.convert_tokens_to_ids(["he", "llo"])
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "hello", "token_ids": [he, llo], "truncated": True}]
    r = render(Conversation("x", msgs), tok, max_length=4096)
    assert r.input_ids[-2:] == [he, llo] and r.loss_mask[-2:] == [1, 1]
    assert tok.eos_token_id not in r.input_ids[r.loss_mask.index(1):]
    assert turn_token_groups(r) == [[he, llo]]
