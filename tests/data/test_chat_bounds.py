"""Chat rendering is bounded and linear (issue 33): a template that loops without end or
multiplies its input is stopped, a long conversation under a template without generation
markers is rendered a bounded number of times (not once per prefix), with the same masks, and a
template that ignores ``add_generation_prompt`` (it would train on every assistant header) is
refused naming the fix."""

from __future__ import annotations

import time

import pytest

from zephon.data import ChatRenderer, ConversationError
from zephon.data.chat import CHAT_TOKENIZER as TOK
from zephon.data.chat import load_chat_template, parse_conversation
from zephon.data.chatbounds import ChatTimeoutError
from zephon.tools.synth import generate_conversations

pytest.importorskip("transformers")

LLAMA3_NO_PROMPT = (
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
)
LLAMA3 = (
    LLAMA3_NO_PROMPT
    + "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _long(n):
    msgs = []
    for i in range(n // 2):
        msgs += [
            {"role": "user", "content": f"question {i} about things"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    return parse_conversation(msgs)


def _count_renders(monkeypatch, r):
    calls = []
    real = r._render

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(r, "_render", counted)
    return calls


@pytest.mark.parametrize("name", ["chatml", "plain"])
def test_a_long_conversation_is_rendered_a_bounded_number_of_times(monkeypatch, name):
    """Without markers, each assistant turn's prefixes were rendered (2 renderings a turn, each
    as long as the conversation: 800 messages took 9.5 s here, 10,000 never finished)."""
    r = ChatRenderer(TOK, load_chat_template(name, TOK))
    calls = _count_renders(monkeypatch, r)
    conv = _long(2000)
    t0 = time.monotonic()
    enc = r.encode(conv)
    assert len(enc.turns) == 1000
    assert len(calls) <= 16  # one whole rendering and the prefixes of a few checked turns
    assert time.monotonic() - t0 < 60  # generous: about 0.2 s here


@pytest.mark.parametrize("name", ["chatml", "plain", "llama3"])
def test_spans_from_one_rendering_equal_the_prefix_renderings(name):
    """The same spans (hence masks) as rendering every prefix, on every conversation the chat
    tests check and on long ones; the one rendering answers for all of them (no fallback)."""
    tpl = LLAMA3 if name == "llama3" else load_chat_template(name, TOK)
    linear, exact = ChatRenderer(TOK, tpl), ChatRenderer(TOK, tpl)
    linear.exact_turns, exact.exact_turns = 0, 10**9
    convs = [_long(60), _long(61 * 2)]
    if name != "llama3":  # that template renders no tool calls
        convs += [parse_conversation(c) for c in generate_conversations(120, seed=7)]
    for conv in convs:
        text, spans = exact.assistant_spans(conv)
        turns = [i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]
        with linear._budget(conv):
            assert linear._tracked_spans(conv, text, turns) == spans
        assert linear.assistant_spans(conv) == (text, spans)
        a, b = linear.encode(conv), exact.encode(conv)
        assert a.ids.tolist() == b.ids.tolist() and a.turns == b.turns


def test_a_template_that_does_not_render_prefixes_falls_back_to_every_prefix():
    """A template whose rendering of a message depends on what follows it (here: the last
    assistant message is written differently) fails the check, so every prefix is rendered and
    the prefix rule refuses it as before."""
    tpl = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if loop.last %}!{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = ChatRenderer(TOK, tpl)
    with pytest.raises(ConversationError, match="as a prefix of the whole one"):
        r.encode(_long(40))


def test_a_template_looping_without_end_is_stopped_at_the_bound():
    tpl = (
        "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        "{{ m.content }}{% endfor %}"
    )
    r = ChatRenderer(TOK, tpl, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ChatTimeoutError, match=r"did not finish rendering it within 1 s .*fix the template"):
        r.encode(_long(4))
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("generation", [False, True])
def test_a_template_multiplying_its_input_is_a_bad_record(generation):
    body = "{% for i in range(100000) %}{{ m.content }}{% endfor %}"
    if generation:
        body = "{% generation %}" + body + "{% endgeneration %}"
    r = ChatRenderer(TOK, "{% for m in messages %}" + body + "{% endfor %}")
    with pytest.raises(ConversationError, match=r"renders it to more than \d+ characters .*fix the template"):
        r.encode(parse_conversation([{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y"}]))


def test_a_template_ignoring_add_generation_prompt_is_refused():
    """Without markers the assistant text starts after the generation prompt: a template that
    renders none would train on every assistant header (4 tokens a turn on Llama 3)."""
    with pytest.raises(ValueError, match=r"renders nothing for add_generation_prompt.*\{% generation %\} markers"):
        ChatRenderer(TOK, LLAMA3_NO_PROMPT)
    r = ChatRenderer(TOK, LLAMA3)  # with the prompt: accepted, the header is not assistant text
    conv = parse_conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}])
    text, spans = r.assistant_spans(conv)
    assert [text[a:b] for a, b in spans] == ["Hello there<|eot_id|>"]


def _chat_recipe(tmp_path, template):
    from zephon import Recipe
    from zephon.tools.chat_demo import write_chat_recipe

    path = write_chat_recipe(str(tmp_path), seq_len=128, conversations=40)
    (tmp_path / "t.jinja").write_text(template)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = text.replace('kind = "chat"\nweight', f'kind = "chat"\nchat_template = "{tmp_path / "t.jinja"}"\nweight', 1)
    text = text.replace("[workers]\ncount = 0", "[workers]\ncount = 0\ntimeout_s = 1")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Recipe.from_toml(path).prepare()


def test_recipe_refusals_name_the_dataset_record_and_fix(tmp_path):
    from zephon.recipe import RecipeError

    looping = (
        "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    t0 = time.monotonic()
    with pytest.raises(
        RecipeError, match=r"dataset 'chat', file '.*part-\d\.jsonl', line \d+: the chat template did not finish"
    ):
        _chat_recipe(tmp_path / "a", looping)
    assert time.monotonic() - t0 < 60
    with pytest.raises(RecipeError, match=r"dataset 'chat': the chat template .* add_generation_prompt"):
        _chat_recipe(tmp_path / "b", LLAMA3_NO_PROMPT)
