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
