"""Chat roles (issue 32, "Roles"): a template's own roles are accepted from data version 6, and a
dataset maps its roles (``roles = {"human" = "user", ...}``).

* A Llama 3.1-style template (its ``ipython`` tool results, a tool call written as the assistant's
  text or as ``tool_calls``), with ``{% generation %}`` markers and its twin without: zephon's ids
  and assistant masks equal transformers' ``apply_chat_template`` (a tokenizer built locally on
  the bundled chat tokenizer, the marked template) on a seeded set of generated conversations.
* Where a template's own role may come (:func:`zephon.data.chat._may_follow`), and the refusals:
  an unknown role names the template's roles; data version 5 refuses ``ipython`` naming
  ``data_version = 6``.
* ``roles`` in both conversation forms and in a recipe run (labels against transformers on the
  records each row's provenance names); a mapping to a role not accepted is refused in one line;
  a recipe without ``roles`` keeps its data definition.
"""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest

from zephon.data import ChatRenderer, ConversationError
from zephon.data.chat import CHAT_TOKENIZER, ROLES, SHAREGPT_ROLES, parse_conversation, template_roles
from zephon.nodes import ChatOptions, provenance_entry, row_spans
from zephon.tools.synth import generate_conversations

transformers = pytest.importorskip("transformers")

#: Llama 3.1's chat template, its tool handling kept (an ``ipython`` or ``tool`` message is a tool
#: result rendered under the ``ipython`` header; a tool call is the assistant's JSON text), with
#: generation markers around each assistant message's text and end of turn
LLAMA31 = """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Environment: ipython\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {%- if message.role == 'assistant' %}
            {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
        {%- else %}
            {{- message['content'] | trim + '<|eot_id|>' }}
        {%- endif %}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {%- generation %}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
        {%- endgeneration %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
#: the same template without generation markers (zephon finds the assistant text from prefixes)
LLAMA31_PLAIN = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", LLAMA31)
V6_ROLES = (*ROLES, "ipython")


def _conversations(n: int, seed: int) -> list[list[dict]]:
    """``n`` conversations with Llama 3.1's tool conventions: a call as the assistant's JSON text
    followed by one or two ``ipython`` results, or as ``tool_calls`` answered by ``ipython``."""
    rng = random.Random(seed)
    out = []
    for conv in generate_conversations(n, seed=seed, max_turns=4):
        msgs: list[dict] = []
        for m in conv:
            if m["role"] == "tool":
                msgs.append({"role": rng.choice(["ipython", "tool"]), "content": m["content"]})
                continue
            if m.get("tool_calls"):
                msgs.append({"role": "assistant", "tool_calls": m["tool_calls"]})
                continue
            msgs.append(m)
            if m["role"] == "user" and rng.random() < 0.6:  # a call written as text, then its results
                name, arg = rng.choice(["search", "weather", "python"]), rng.choice(["Paris", "x**2", "zephon"])
                msgs.append({"role": "assistant", "content": json.dumps({"name": name, "parameters": {"q": arg}})})
                for k in range(rng.choice([1, 1, 2])):
                    msgs.append({"role": "ipython", "content": f"result {k} of {name}: {rng.randint(0, 999)}"})
        out.append(msgs)
    return out


CONVS = _conversations(300, seed=11)


@pytest.fixture(scope="module")
def hf():
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(CHAT_TOKENIZER, "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )


def _reference(hf, conv):
    out = hf.apply_chat_template(
        conv, chat_template=LLAMA31, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_the_conversations_cover_the_cases():
    roles = [m["role"] for c in CONVS for m in c]
    assert roles.count("ipython") > 200 and "tool" in roles
    assert sum(any(m["role"] == "ipython" for m in c) for c in CONVS) > 150
    after_text = [c[i - 1] for c in CONVS for i, m in enumerate(c) if m["role"] == "ipython"]
    assert any(b["role"] == "assistant" and not b.get("tool_calls") for b in after_text)  # a call as text
    assert any(b["role"] == "ipython" for b in after_text) and any(b.get("tool_calls") for b in after_text)


def test_the_template_roles_are_found_from_its_source():
    assert template_roles(LLAMA31) == ("assistant", "ipython", "system", "tool")
    assert ChatRenderer(CHAT_TOKENIZER, LLAMA31).roles == V6_ROLES
    aliased = (
        "{% for m in messages %}{% set r = m.get('role') | lower %}{% if 'developer' == r %}D{% endif %}{% endfor %}"
    )
    assert template_roles(aliased) == ("developer",)
    printed = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}"
    assert template_roles(printed) == () and template_roles("{% if %}") == ()


@pytest.mark.parametrize("template", [LLAMA31, LLAMA31_PLAIN], ids=["markers", "no-markers"])
def test_ipython_conversations_equal_transformers_ids_and_masks(hf, template):
    r = ChatRenderer(CHAT_TOKENIZER, template)
    assert r.markers == (template is LLAMA31)
    opts = ChatOptions()
    for conv in CONVS:
        enc = r.encode(opts.parse(conv, r))
        ids, mask = _reference(hf, conv)
        assert enc.ids.tolist() == ids
        got = np.zeros(len(ids), int)
        for a, b in enc.turns:
            got[a:b] = 1
        assert got.tolist() == mask, conv


def test_data_version_5_refuses_the_template_roles_naming_the_fix():
    r = ChatRenderer(CHAT_TOKENIZER, LLAMA31)
    conv = next(c for c in CONVS if any(m["role"] == "ipython" for m in c))
    with pytest.raises(ConversationError, match=r"data versions before 6 refuse; set data_version = 6") as e:
        ChatOptions(template_roles=False).parse(conv, r)
    assert "\n" not in str(e.value)
    assert ChatOptions().parse(conv, r)["messages"][-1]["role"] == "assistant"
    with pytest.raises(ConversationError, match=r"unknown role 'ipython' \(known: system, user, assistant, tool\)"):
        parse_conversation(conv)  # no template: the standard roles only


def test_an_unknown_role_is_refused_naming_the_template_roles():
    r = ChatRenderer(CHAT_TOKENIZER, LLAMA31)
    conv = [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]
    with pytest.raises(ConversationError) as e:
        ChatOptions().parse(conv, r)
    assert str(e.value) == (
        "message 1 has unknown role 'robot' (known: system, user, assistant, tool, ipython; the chat template's "
        "own: ipython); map it to a known role with the dataset's roles key"
    )


def _turns(*roles: str, calls: int = -1) -> list[dict]:
    """Messages of ``roles`` (``calls``: the index of an assistant message with ``tool_calls``)."""
    call = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    return [
        {"role": role, "tool_calls": call} if i == calls else {"role": role, "content": f"m{i}"}
        for i, role in enumerate(roles)
    ]


@pytest.mark.parametrize(
    ("roles", "calls", "ok"),
    [
        (("user", "assistant", "ipython", "assistant"), -1, True),  # the call as text (Llama 3.1)
        (("user", "assistant", "ipython", "ipython", "assistant"), -1, True),
        (("user", "assistant", "ipython", "tool", "assistant"), 1, True),
        (("user", "assistant", "tool", "assistant"), -1, False),  # OpenAI's tool: after tool_calls only
        (("user", "ipython", "assistant"), -1, False),
        (("ipython", "assistant"), -1, False),
        (("user", "assistant", "ipython", "user", "assistant"), -1, False),  # an answer first
        (("developer", "user", "assistant"), -1, True),  # where a system message may be
        (("system", "developer", "user", "assistant"), -1, True),
        (("user", "assistant", "developer", "assistant"), -1, True),  # where a user message may be
        (("user", "developer", "assistant"), -1, False),
        (("developer", "system", "user", "assistant"), -1, False),
    ],
)
def test_where_a_template_role_may_come(roles, calls, ok):
    conv = _turns(*roles, calls=calls)
    accepted = (*ROLES, "ipython", "developer")
    if ok:
        assert [m["role"] for m in parse_conversation(conv, roles=accepted)["messages"]] == list(roles)
    else:
        with pytest.raises(ConversationError, match="comes (after|first)"):
            parse_conversation(conv, roles=accepted)


def test_roles_map_in_both_forms():
    r = ChatRenderer(CHAT_TOKENIZER, LLAMA31)
    conv = [
        {"role": "human", "content": "weather?"},
        {"role": "assistant", "content": '{"name": "weather", "parameters": {}}'},
        {"role": "function_response", "content": "sunny"},
        {"role": "model", "content": "It is sunny."},
    ]
    want = ["user", "assistant", "ipython", "assistant"]
    rename = {"human": "user", "function_response": "ipython", "model": "assistant"}
    got = ChatOptions(roles=rename).parse(conv, r)["messages"]
    assert [m["role"] for m in got] == want and [m["content"] for m in got] == [m["content"] for m in conv]
    share = [{"from": {"model": "gpt"}.get(m["role"], m["role"]), "value": m["content"]} for m in conv]
    got = ChatOptions("sharegpt", roles={"function_response": "ipython"}).parse(share, r)["messages"]
    assert [m["role"] for m in got] == want  # "human" and "gpt" from SHAREGPT_ROLES
    # the mapping overrides SHAREGPT_ROLES, and a ShareGPT "from" that is an accepted role is that role
    share = [{"from": w, "value": f"m{i}"} for i, w in enumerate(["human", "user", "gpt", "ipython", "gpt"])]
    got = ChatOptions("sharegpt", roles={"human": "system"}).parse(share, r)["messages"]
    assert [m["role"] for m in got] == ["system", "user", "assistant", "ipython", "assistant"]
    with pytest.raises(ConversationError, match="unknown role 'function_response'"):
        ChatOptions().parse(conv[2:], r)  # without the mapping: refused before any other check


# -- in a recipe -------------------------------------------------------------------------------
_SHARE = {v: k for k, v in SHAREGPT_ROLES.items() if k in ("human", "gpt", "system")} | {"ipython": "function_response"}


def _write(root, data_version=6, roles=None, template=LLAMA31):
    """A recipe of two chat datasets on the Llama 3.1-style template: JSONL in the messages form
    (roles "human" and "function_response") and in the ShareGPT form ("function_response")."""
    os.makedirs(os.path.join(root, "msgs"), exist_ok=True)
    os.makedirs(os.path.join(root, "share"), exist_ok=True)
    with open(os.path.join(root, "t.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    convs = _conversations(160, seed=5)
    rename = {"user": "human", "ipython": "function_response"}
    with open(os.path.join(root, "msgs", "part-0.jsonl"), "w", encoding="utf-8") as f:
        for c in convs[:80]:
            f.write(json.dumps({"messages": [m | {"role": rename.get(m["role"], m["role"])} for m in c]}) + "\n")
    with open(os.path.join(root, "share", "part-0.jsonl"), "w", encoding="utf-8") as f:
        for c in convs[80:]:
            if all(m["role"] in _SHARE and "tool_calls" not in m for m in c):
                f.write(json.dumps({"conversations": [{"from": _SHARE[m["role"]], "value": m["content"]} for m in c]}))
                f.write("\n")
    chat = {"kind": "chat", "chat_template": "t.jinja", "long": "truncate_turns"}
    return {
        "seed": 3,
        "lanes": 2,
        "seq_len": 384,
        "global_batch_size": 4,
        "data_version": data_version,
        "cache_dir": "cache",
        "tokenizer": {"path": CHAT_TOKENIZER},
        "datasets": [
            chat
            | {
                "name": "msgs",
                "path": "msgs/*.jsonl",
                "roles": roles or {"human": "user", "function_response": "ipython"},
            },
            chat
            | {
                "name": "share",
                "path": "share/*.jsonl",
                "chat_format": "sharegpt",
                "roles": {"function_response": "ipython"},
            },
        ],
        "pack": {"algorithm": "best_fit"},
        "shuffle": {"buffer": 4},
        "workers": {"count": 0},
    }


def _record(r, d, shard, record):
    """The conversation of a record as the dataset's roles map it, read with json."""
    where = r.indexes[d].locate(shard, record)
    with open(where["file"], encoding="utf-8") as f:
        row = json.loads(f.read().splitlines()[int(where["locator"].split()[1]) - 1])
    rename = r.datasets[d].roles
    if "conversations" in row:
        return [{"role": (SHAREGPT_ROLES | rename)[m["from"]], "content": m["value"]} for m in row["conversations"]]
    return [m | {"role": rename.get(m["role"], m["role"])} for m in row["messages"]]


@pytest.mark.parametrize("template", [LLAMA31, LLAMA31_PLAIN], ids=["markers", "no-markers"])
def test_a_recipe_maps_roles_and_trains_on_the_assistant_tokens_only(tmp_path, hf, template):
    from zephon import Recipe

    r = Recipe(_write(str(tmp_path), template=template), str(tmp_path))
    checked = ipython = 0
    seen = set()
    with r.global_loader(world_size=1) as g:
        for _ in range(6):
            b = next(g)
            for row in range(b["input"].shape[0]):
                labels = b["labels"][row]
                tokens = np.append(b["input"][row], labels[-1])
                for entry, (lo, hi) in zip(b["provenance"][row], row_spans(b["provenance"][row])):
                    p = provenance_entry(entry)
                    conv = _record(r, p.dataset, p.shard, p.record)
                    ids, mask = (np.asarray(x) for x in _reference(hf, conv))
                    n = min(hi - lo, len(ids))  # a truncated conversation: its first turns
                    assert tokens[lo : lo + n][: len(labels) - lo].tolist() == ids[:n][: len(labels) - lo].tolist()
                    want = np.where(mask[1:n], ids[1:n], -100)
                    got = labels[lo : min(lo + n - 1, len(labels))]
                    assert got.tolist() == want[: len(got)].tolist()
                    checked += 1
                    seen.add(p.dataset)
                    ipython += any(m["role"] == "ipython" for m in conv)
    assert checked > 20 and ipython > 10 and seen == {0, 1}  # both forms
    assert {s.name: s.roles for s in r.datasets}["share"] == {"function_response": "ipython"}


def test_a_mapping_to_a_role_not_accepted_is_refused_in_one_line(tmp_path):
    from zephon import Recipe
    from zephon.recipe import RecipeError

    bad = Recipe(_write(str(tmp_path / "a"), roles={"function_response": "robot"}), str(tmp_path / "a"))
    with pytest.raises(RecipeError) as e:
        bad.prepare()
    assert str(e.value) == (
        "recipe: dataset 'msgs': roles maps 'function_response' to 'robot', which is not an accepted role "
        "(accepted: system, user, assistant, tool, ipython); map it to one of them"
    )
    old = Recipe(_write(str(tmp_path / "b"), data_version=5), str(tmp_path / "b"))
    with pytest.raises(RecipeError, match=r"^[^\n]*'ipython'.*map it to one of them, or set data_version = 6 [^\n]*$"):
        old.prepare()
    with pytest.raises(RecipeError, match=r"roles must be a table of names to non-empty role names"):
        Recipe(_write(str(tmp_path / "c"), roles={"human": 3}), str(tmp_path / "c"))
    text = _write(str(tmp_path / "d"))
    text["datasets"].append({"name": "web", "path": "msgs/*.jsonl", "roles": {"a": "user"}})
    with pytest.raises(RecipeError, match=r"'web'.roles only applies to kind = \"chat\""):
        Recipe(text, str(tmp_path / "d"))


def test_roles_enter_the_data_definition_only_when_given(tmp_path):
    from zephon import Recipe

    cfg = _write(str(tmp_path))
    with_roles = Recipe(cfg, str(tmp_path)).spec.data_definition()
    assert with_roles["datasets"][0]["roles"] == {"human": "user", "function_response": "ipython"}
    for d in cfg["datasets"]:
        del d["roles"]
    without = Recipe(cfg, str(tmp_path)).spec.data_definition()
    assert all("roles" not in d for d in without["datasets"])
    assert without["datasets"][0] == {k: v for k, v in with_roles["datasets"][0].items() if k != "roles"}
