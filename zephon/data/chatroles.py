"""Chat roles: which a conversation may have, how a dataset renames them, where each may come.

The standard roles (:data:`ROLES`) are accepted always; a template's own roles
(:func:`template_roles`: every role string its source compares a message's role with, e.g. Llama
3.1's ``ipython``) when the caller accepts them (a recipe from data version 6: ``roles`` of
:func:`~zephon.data.chat.parse_conversation`, a renderer's
:attr:`~zephon.data.chat.ChatRenderer.roles`). A dataset may rename its roles first (``rename``:
``{"human": "user"}``), before every check. Where a role may appear:
a tool result of the template's own (:data:`TOOL_RESULTS`: ``ipython``, ``function``,
``observation``) after any assistant message or another tool result, because the formats that
use them write the call as the assistant's text (Llama 3.1's ``<|python_tag|>`` or JSON
``{"name": ..., "parameters": ...}`` content, no ``tool_calls``); ``tool`` keeps OpenAI's rule (after
an assistant's ``tool_calls`` or another tool result); any other template role (``developer``)
where a system or a user message may be (first, or after an assistant message), and what may
follow a system or a user message may follow it. Only ``assistant`` messages are trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ROLES", "SHAREGPT_ROLES", "TOOL_RESULTS", "may_follow", "role_refusal", "template_roles"]

#: the standard roles, accepted with every template
ROLES = ("system", "user", "assistant", "tool")
#: roles that hold a tool's result (where a template's own one may appear: module doc)
TOOL_RESULTS = ("tool", "ipython", "function", "observation")
#: ShareGPT ``from`` values and the roles they become
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
}


def template_roles(template: str) -> tuple[str, ...]:
    """The roles a chat template tells apart, sorted: every string its source compares a
        message's role with (``message.role == "ipython"``, ``message['role'] != 'system'``,
        ``m.role in ["tool", "ipython"]``, either side, also through a variable set from the role).
        Read from the template's syntax tree (Jinja's parser as transformers configures it), so
        quoting, spacing and variable names do not matter; a role only printed is not one (the
        template does not tell it apart). A template that compares a role only to refuse it
    (``raise_exception``) makes it its own too: such a conversation fails to render, a bad record
    naming the template's message. None when the template does not parse (it fails to render).

        >>> template_roles("{% for m in messages %}{% if m['role'] in ('tool', 'ipython') %}R{% endif %}{% endfor %}")
        ('ipython', 'tool')
    """
    try:
        from jinja2 import nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return ()
    aliases: set[str] = set()

    def is_role(n: Any) -> bool:
        if isinstance(n, nodes.Getattr):
            return n.attr == "role"
        if isinstance(n, nodes.Getitem):
            return isinstance(n.arg, nodes.Const) and n.arg.value == "role"
        if isinstance(n, nodes.Call) and isinstance(n.node, nodes.Getattr) and n.node.attr == "get" and n.args:
            return isinstance(n.args[0], nodes.Const) and n.args[0].value == "role"
        if isinstance(n, nodes.Filter) and n.name in ("lower", "trim", "string") and n.node is not None:
            return is_role(n.node)
        return isinstance(n, nodes.Name) and n.name in aliases

    sets = [a for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    while True:  # variables set from a role (``{% set role = message['role'] %}``), to a fixed point
        more = {a.target.name for a in sets if is_role(a.node)} - aliases
        if not more:
            break
        aliases |= more
    found: set[str] = set()
    for c in tree.find_all(nodes.Compare):
        left = c.expr
        for op in c.ops:
            right = op.expr
            if op.op in ("eq", "ne"):
                for a, b in ((left, right), (right, left)):
                    if is_role(a) and isinstance(b, nodes.Const) and isinstance(b.value, str):
                        found.add(b.value)
            elif op.op in ("in", "notin") and is_role(left) and isinstance(right, (nodes.List, nodes.Tuple)):
                found |= {x.value for x in right.items if isinstance(x, nodes.Const) and isinstance(x.value, str)}
            left = right
    return tuple(sorted(r for r in found if r.strip()))


def role_refusal(i: int, what: str, value: Any, names: Sequence[str], known: Sequence[str]) -> str:
    """The refusal of a role not accepted, naming the accepted ones and the template's own."""
    if isinstance(value, str) and value in known:  # the template's, not accepted (data version <= 5)
        return (
            f"message {i} has {what} {value!r}, a role the chat template renders but data versions before 6 refuse; "
            "set data_version = 6 at the recipe's top level (or map it with the dataset's roles key)"
        )
    own = [r for r in known if r not in ROLES]
    theirs = f"; the chat template's own: {', '.join(own)}" if own else ""
    return (
        f"message {i} has unknown {what} {value!r} (known: {', '.join(names)}{theirs}); map it to a known role "
        "with the dataset's roles key"
    )


def may_follow(role: str, prev: str | None, before: dict[str, Any] | None) -> bool:
    """Whether a ``role`` message may come after ``before`` (a ``prev`` message; None: first).
    The standard roles alternate (a system first only); a template's own roles are placed as
    the module doc says (a tool result of its own after any assistant message: its call is text)."""
    loose = prev is not None and prev not in ROLES and prev not in TOOL_RESULTS  # a system-or-user role
    if role == "system":
        return prev is None
    if role == "user":
        return prev in (None, "system", "assistant") or loose
    if role == "assistant":
        return prev == "user" or prev in TOOL_RESULTS or loose
    if role == "tool":
        return prev in TOOL_RESULTS or (prev == "assistant" and before is not None and bool(before.get("tool_calls")))
    if role in TOOL_RESULTS:
        return prev == "assistant" or prev in TOOL_RESULTS
    return prev in (None, "system", "assistant") or loose  # where a system or a user message may be
