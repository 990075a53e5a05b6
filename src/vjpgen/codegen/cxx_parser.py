"""A small Pratt parser for the C++ expression dialect of derivatives.yaml formulas.

It turns a formula such as ``grad.defined() ? sum_backward(grad, self_sym_sizes, dim, keepdim)
: Tensor()`` into a tree of :class:`Node` tuples that :mod:`codegen.translate` lowers to Python.
It covers what the formulas use: literals, qualified names (``at::where``, ``std::nullopt``) with
template arguments (``std::get<0>``, ``std::tuple<Tensor, Tensor>``), calls, method calls, ``->``,
indexing, unary and binary operators with C++ precedence, the ternary operator, brace lists
(``{a, b}``, ``{{0, 0}}``) and capture-less or ``[&]`` lambdas ``[](T x){ return e; }``.

Errors raise :class:`ParseError` carrying the character offset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class ParseError(ValueError):
    """A formula that is not valid in the supported C++ subset; ``pos`` is the character offset."""

    def __init__(self, message: str, pos: int):
        super().__init__(message)
        self.message = message
        self.pos = pos


@dataclass(frozen=True)
class Node:
    """One parsed expression node: ``kind`` plus kind-specific ``args`` (see module docstring)."""

    kind: str  # num str name call member arrow index unary binary ternary braces lambda
    args: tuple
    pos: int = 0


_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+|/\*.*?\*/|//[^\n]*)
  | (?P<num>(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[fFlLuU]*)
  | (?P<str>"(\\.|[^"\\])*")
  | (?P<name>(::)?[A-Za-z_][A-Za-z_0-9]*(::[A-Za-z_][A-Za-z_0-9]*)*)
  | (?P<op>->|::|\|\||&&|==|!=|<=|>=|<<|>>|[-+*/%<>!?:.,()\[\]{}&|^~;=])
    """,
    re.VERBOSE | re.DOTALL,
)

# Names after which ``<`` opens a template argument list rather than a comparison.
TEMPLATE_NAMES = {
    "get",
    "tuple",
    "vector",
    "static_cast",
    "optional",
    "array",
    "OptionalArray",
    "List",
    "ArrayRef",
    "make_tuple",
    "OptionalArrayRef",
}

# Binary operators: precedence (higher binds tighter), as in C++.
_BINARY = {
    "||": 1,
    "&&": 2,
    "|": 3,
    "^": 4,
    "&": 5,
    "==": 6,
    "!=": 6,
    "<": 7,
    ">": 7,
    "<=": 7,
    ">=": 7,
    "<<": 8,
    ">>": 8,
    "+": 9,
    "-": 9,
    "*": 10,
    "/": 10,
    "%": 10,
}
_TERNARY_PREC = 0
_UNARY_PREC = 11


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    pos: int


def tokenize(src: str) -> list[Token]:
    """Split a formula into tokens; comments and whitespace are dropped."""
    out: list[Token] = []
    i = 0
    while i < len(src):
        m = _TOKEN_RE.match(src, i)
        if not m:
            raise ParseError(f"unexpected character {src[i]!r}", i)
        kind = m.lastgroup
        if kind != "ws":
            text = m.group(kind)
            if kind == "name" and text.startswith("::"):
                text = text[2:]
            out.append(Token(kind, text, i))
        i = m.end()
    out.append(Token("eof", "", len(src)))
    return out


class Parser:
    def __init__(self, src: str):
        self.src = src
        self.toks = tokenize(src)
        self.i = 0

    # -- token helpers -------------------------------------------------------------------
    def peek(self, k: int = 0) -> Token:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def next(self) -> Token:
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, text: str) -> Token:
        t = self.next()
        if t.text != text:
            raise ParseError(f"expected {text!r}, found {t.text or 'end of formula'!r}", t.pos)
        return t

    def accept(self, text: str) -> bool:
        if self.peek().kind != "str" and self.peek().text == text:
            self.i += 1
            return True
        return False

    # -- grammar -------------------------------------------------------------------------
    def parse(self) -> Node:
        e = self.expr()
        t = self.peek()
        if t.kind != "eof":
            raise ParseError(f"unexpected {t.text!r} after the end of the expression", t.pos)
        return e

    def expr(self, min_prec: int = _TERNARY_PREC) -> Node:
        left = self.unary()
        while True:
            t = self.peek()
            if t.kind == "op" and t.text == "?" and min_prec <= _TERNARY_PREC:
                self.next()
                then = self.expr(_TERNARY_PREC)
                self.expect(":")
                other = self.expr(_TERNARY_PREC)  # right-associative
                left = Node("ternary", (left, then, other), t.pos)
                continue
            prec = _BINARY.get(t.text) if t.kind == "op" else None
            if prec is None or prec < min_prec:
                return left
            self.next()
            right = self.expr(prec + 1)
            left = Node("binary", (t.text, left, right), t.pos)

    def unary(self) -> Node:
        t = self.peek()
        if t.kind == "op" and t.text in ("!", "-", "+", "~"):
            self.next()
            return Node("unary", (t.text, self.expr(_UNARY_PREC)), t.pos)
        return self.postfix(self.primary())

    def postfix(self, e: Node) -> Node:
        while True:
            t = self.peek()
            if t.text == "(" and t.kind == "op":
                e = Node("call", (e, tuple(self.arglist("(", ")"))), t.pos)
            elif t.text in (".", "->") and t.kind == "op":
                self.next()
                name = self.next()
                if name.kind != "name":
                    raise ParseError(f"expected a member name after {t.text!r}", name.pos)
                targs = self.template_args(name.text)
                e = Node("member" if t.text == "." else "arrow", (e, name.text, targs), t.pos)
            elif t.text == "[" and t.kind == "op":
                self.next()
                idx = self.expr()
                self.expect("]")
                e = Node("index", (e, idx), t.pos)
            else:
                return e

    def arglist(self, open_: str, close: str) -> list[Node]:
        self.expect(open_)
        items: list[Node] = []
        if self.accept(close):
            return items
        while True:
            items.append(self.expr())
            if self.accept(close):
                return items
            self.expect(",")

    def template_args(self, name: str) -> tuple[str, ...] | None:
        """Read ``<...>`` after a template name, returned as the raw argument texts."""
        if name.split("::")[-1] not in TEMPLATE_NAMES or self.peek().text != "<":
            return None
        start = self.next()
        depth, parts, cur = 1, [], []
        while True:
            t = self.next()
            if t.kind == "eof":
                raise ParseError("unterminated template argument list", start.pos)
            if t.text == "<":
                depth += 1
            elif t.text == ">":
                depth -= 1
                if depth == 0:
                    parts.append(" ".join(cur))
                    return tuple(p for p in parts if p)
            elif t.text == ">>":
                depth -= 2
                if depth <= 0:
                    parts.append(" ".join(cur))
                    return tuple(p for p in parts if p)
            if t.text == "," and depth == 1:
                parts.append(" ".join(cur))
                cur = []
            else:
                cur.append(t.text)

    def primary(self) -> Node:
        t = self.next()
        if t.kind == "num":
            return Node("num", (t.text,), t.pos)
        if t.kind == "str":
            return Node("str", (t.text,), t.pos)
        if t.kind == "name":
            return Node("name", (t.text, self.template_args(t.text)), t.pos)
        if t.text == "(":
            e = self.expr()
            self.expect(")")
            return e
        if t.text == "{":
            self.i -= 1
            return Node("braces", tuple(self.arglist("{", "}")), t.pos)
        if t.text == "[":
            return self.lambda_(t)
        raise ParseError(f"unexpected {t.text or 'end of formula'!r}", t.pos)

    def lambda_(self, start: Token) -> Node:
        # capture list: [] or [&] or [=]
        while not self.accept("]"):
            if self.next().kind == "eof":
                raise ParseError("unterminated lambda capture list", start.pos)
        self.expect("(")
        params: list[str] = []
        last_name = None
        while True:
            t = self.next()
            if t.kind == "eof":
                raise ParseError("unterminated lambda parameter list", start.pos)
            if t.kind == "name":
                last_name = t.text
            elif t.text in (",", ")"):
                if last_name is not None:
                    params.append(last_name)
                last_name = None
                if t.text == ")":
                    break
        self.expect("{")
        ret = self.next()
        if ret.text != "return":
            raise ParseError("only lambdas of the form { return <expr>; } are supported", ret.pos)
        body = self.expr()
        self.accept(";")
        self.expect("}")
        return Node("lambda", (tuple(params), body), start.pos)


def parse(src: str) -> Node:
    """Parse one formula; raises :class:`ParseError` with the offending position."""
    return Parser(src).parse()
