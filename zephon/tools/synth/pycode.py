"""The ``"code"`` style: Python-like modules (imports, functions, classes, indentation,
literals, operators), with clearly more tokens per byte than prose."""

from __future__ import annotations

import keyword

from .words import _VOCAB_SIZE, _Stream, _vocab

_MODULES = (
    "os",
    "sys",
    "json",
    "re",
    "math",
    "time",
    "typing",
    "pathlib",
    "itertools",
    "collections",
    "dataclasses",
    "functools",
    "numpy as np",
    "logging",
)
_BASES = ("object", "Exception", "dict", "Base", "nn.Module", "Protocol")
_OPS = (" + ", " - ", " * ", " // ", " % ", " == ", " != ", " < ", " >= ", " and ", " or ")
_BUILTINS = ("len", "range", "sorted", "list", "dict", "str", "int", "min", "max", "sum", "zip", "enumerate")


def _code_word(s: _Stream) -> str:
    """Identifier parts: one third Zipf-common, two thirds uniform over the vocabulary (code
    names are more diverse than prose, so code has more tokens per byte)."""
    if s.chance(1, 3):
        return s.word()
    return _vocab()[2][s.below(_VOCAB_SIZE)]


def _ident(s: _Stream) -> str:
    name = "_".join(_code_word(s) for _ in range(1 + s.below(3)))
    return name + "_" if keyword.iskeyword(name) else name


def _camel(s: _Stream) -> str:
    return "".join(_code_word(s).capitalize() for _ in range(1 + s.below(3)))


def _atom(s: _Stream, names: list[str]) -> str:
    k = s.below(10)
    if k < 4 and names:
        return s.pick(names)
    if k < 6:
        k = s.below(8)
        if k < 4:
            return str(s.below(256))
        if k < 6:
            return f"{s.below(100)}.{s.below(100)}"
        return f"0x{s.u64() & 0xFFFF:04x}" if k == 6 else f"{1 + s.below(9)}e-{1 + s.below(9)}"
    if k < 8:
        return f'"{s.word()}"' if s.chance(1, 2) else f"'{s.word()}_{s.word()}'"
    if k == 8:
        return "None" if s.chance(1, 2) else s.pick(("True", "False"))
    return f"self.{s.word()}"


def _expr(s: _Stream, names: list[str], depth: int = 0) -> str:
    k = s.below(12) if depth < 2 else 0
    if k < 4:
        return _atom(s, names)
    if k < 6:
        return _expr(s, names, depth + 1) + s.pick(_OPS) + _expr(s, names, depth + 1)
    if k < 8:
        fn = s.pick(_BUILTINS) if s.chance(1, 2) else _ident(s)
        args = ", ".join(_expr(s, names, depth + 1) for _ in range(s.below(3)))
        return f"{fn}({args})"
    if k == 8:
        v = s.pick(names) if names else "x"
        return f"[{v} * {s.below(10)} for {v} in {_atom(s, names)}]"
    if k == 9:
        return f'{{"{s.word()}": {_atom(s, names)}, "{s.word()}": {_atom(s, names)}}}'
    if k == 10:
        return f"{_atom(s, names)}[{s.below(8)}]"
    return f'f"{s.word()} {{{_atom(s, names)}}}"'


def _block(s: _Stream, out: list[str], ind: str, names: list[str], budget: int, depth: int) -> int:
    n = 1 + s.below(5)
    for _ in range(n):
        if budget <= 0:
            break
        k = s.below(14)
        if k < 5:
            v = _ident(s)
            out.append(f"{ind}{v} = {_expr(s, names)}")
            names.append(v)
            budget -= 1
        elif k < 7 and depth < 3:
            v = s.pick(("i", "item", "row", "key", "node", "line", "k"))
            out.append(f"{ind}for {v} in {_expr(s, names, 1)}:")
            names.append(v)
            budget = _block(s, out, ind + "    ", names, budget - 1, depth + 1)
        elif k < 9 and depth < 3:
            out.append(f"{ind}if {_expr(s, names, 1)}:")
            budget = _block(s, out, ind + "    ", names, budget - 1, depth + 1)
            if s.chance(1, 3):
                out.append(f"{ind}else:")
                budget = _block(s, out, ind + "    ", names, budget - 1, depth + 1)
        elif k < 11:
            out.append(f"{ind}# {' '.join(s.word() for _ in range(2 + s.below(8)))}")
            budget -= 1
        elif k < 13:
            obj = s.pick(names) if names else "self"
            out.append(f"{ind}{obj}.{s.word()}({_expr(s, names, 1)})")
            budget -= 1
        else:
            out.append(f'{ind}raise ValueError(f"{s.word()} {{{_atom(s, names)}!r}}")')
            budget -= 1
    return budget


def _function(s: _Stream, out: list[str], ind: str, method: bool, budget: int) -> int:
    params = [_ident(s) for _ in range(s.below(4))]
    sig = ", ".join(
        (["self"] if method else [])
        + [p + (f": {s.pick(('int', 'str', 'float', 'list', 'dict'))}" if s.chance(1, 2) else "") for p in params]
    )
    ret = f" -> {s.pick(('int', 'str', 'bool', 'None', 'list[str]', 'dict'))}" if s.chance(1, 2) else ""
    out.append(f"{ind}def {_ident(s)}({sig}){ret}:")
    if s.chance(1, 2):
        out.append(f'{ind}    """{" ".join(s.word() for _ in range(3 + s.below(10))).capitalize()}."""')
    names = list(params)
    budget = _block(s, out, ind + "    ", names, budget, 1)
    out.append(f"{ind}    return {_expr(s, names)}")
    return budget - 2


def _code_doc(s: _Stream) -> str:
    budget = s.lognormal_int(30.0, 0.8, 4, 2000)
    out: list[str] = []
    for _ in range(s.below(5)):
        m = s.pick(_MODULES)
        out.append(f"import {m}" if s.chance(1, 2) or " as " in m else f"from {m} import {_ident(s)}, {_camel(s)}")
    if out:
        out.append("")
    if s.chance(1, 3):
        out.append(f"{_ident(s).upper()} = {s.below(4096)}")
        out.append("")
    while budget > 0:
        if s.chance(1, 3):
            out.append("")
            out.append(f"class {_camel(s)}({s.pick(_BASES)}):")
            if s.chance(1, 2):
                out.append(f'    """{" ".join(s.word() for _ in range(4 + s.below(8))).capitalize()}."""')
            for _ in range(1 + s.below(3)):
                out.append("")
                budget = _function(s, out, "    ", True, min(budget, 12))
        else:
            out.append("")
            budget = _function(s, out, "", False, min(budget, 15))
        out.append("")
    return "\n".join(out).strip("\n") + "\n"
