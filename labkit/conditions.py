"""The language of claims (``labkit.claims``): conditions over figure names, sentence templates, and the rules by
which the checker refuses a claim that cannot fail.

* ``parse`` / ``evaluate_expression``: a condition is a Python expression over figure names (``area.figure``):
  comparisons, arithmetic, ``and`` / ``or`` / ``not``, ``abs`` / ``min`` / ``max``, numbers, strings, booleans.
* ``render``: a sentence template's ``{area.figure:spec}`` fields filled from values; the spec
  ``if OP OPERAND then WORDS else WORDS`` picks words from the data (a verb that follows the machine).
* ``written_refusal`` (vacuous, self-compared, tautological) and ``bool_as_number``: the refusals.
* ``wording_problems``: where a sentence's words ("faster", "no faster", "compute-bound", "fits", ...) say more or
  less than its condition tests (a heuristic the workbook's tests apply to every claim).
"""

from __future__ import annotations

import ast
import random
import re
import string
from functools import lru_cache

_FUNCTIONS = {"abs": abs, "min": min, "max": max}
COMPARE = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
            ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}
_OPS = {"<": ast.Lt, "<=": ast.LtE, ">": ast.Gt, ">=": ast.GtE, "==": ast.Eq, "!=": ast.NotEq}
_CHOICE = re.compile(r"^if\s*(<=|>=|==|!=|<|>)\s*(\S+)\s+then\s+(.*?)\s+else\s+(.*)$", re.S)


class ClaimError(ValueError):
    """A claim that cannot be evaluated: a bad condition, a missing figure, a value of the wrong type."""


class ClaimRefused(ClaimError):
    """A claim the checker refuses: it cannot fail, or it tests nothing (the message names the rule)."""


# --- conditions ---------------------------------------------------------------------------------------------------
def parse(condition: str) -> ast.Expression:
    if not isinstance(condition, str) or not condition.strip():
        raise ValueError(f"condition={condition!r}: need an expression over figure names, e.g. 'engine.x > 1'")
    try:
        tree = ast.parse(condition, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"condition={condition!r} is not an expression: {e.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant,
                                 ast.Attribute, ast.Name, ast.Call, ast.Load, ast.And, ast.Or, ast.Not, ast.USub,
                                 *COMPARE, *_BINARY)):
            raise ValueError(f"condition={condition!r}: {type(node).__name__} is not allowed (comparisons, "
                             f"arithmetic, and/or/not, abs/min/max, constants and figure names)")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            raise ValueError(f"condition={condition!r}: only {sorted(_FUNCTIONS)} may be called")
    return tree


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def figure_names(tree: ast.AST) -> list[str]:
    """The figure names a condition reads, in order: each outermost dotted name (not a called function's)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Attribute, ast.Name)):
            names.append(dotted(node) or "")
            return
        if isinstance(node, ast.Call):
            for a in node.args:
                visit(a)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    for n in names:
        check_name(n)
    return names


def check_name(name: str) -> None:
    if "." not in name or "__" in name or not all(p.isidentifier() for p in name.split(".")):
        raise ValueError(f"{name!r} is not a figure name ('area.figure')")


def evaluate_expression(node: ast.AST, values: dict):
    if isinstance(node, ast.Expression):
        return evaluate_expression(node.body, values)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Attribute, ast.Name)):
        name = dotted(node)
        if name not in values:
            raise ClaimError(f"figure {name!r} is not in the figures")
        return values[name]
    if isinstance(node, ast.Compare):
        left = evaluate_expression(node.left, values)
        for op, right_node in zip(node.ops, node.comparators):
            right = evaluate_expression(right_node, values)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        parts = (evaluate_expression(v, values) for v in node.values)
        return all(parts) if isinstance(node.op, ast.And) else any(parts)
    if isinstance(node, ast.UnaryOp):
        v = evaluate_expression(node.operand, values)
        return (not v) if isinstance(node.op, ast.Not) else -v
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](evaluate_expression(node.left, values), evaluate_expression(node.right, values))
    if isinstance(node, ast.Call):
        return _FUNCTIONS[node.func.id](*(evaluate_expression(a, values) for a in node.args))
    raise ClaimError(f"cannot evaluate {ast.dump(node)}")


def comparisons(tree: ast.AST) -> list[tuple[ast.AST, type, ast.AST]]:
    """Every comparison of a condition as (left, operator type, right), chains split into pairs."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators):
                out.append((left, type(op), right))
                left = right
    return out


# --- refusals -----------------------------------------------------------------------------------------------------
def _self_compared(tree: ast.AST) -> str | None:
    for left, _, right in comparisons(tree):
        lf, rf = set(figure_names(left)), set(figure_names(right))
        if lf and lf == rf:
            return ", ".join(sorted(lf))
    return None


@lru_cache(maxsize=1024)
def _tautological(condition: str) -> bool:
    """Whether ``condition`` held for every probe of its figures' values (numbers around each constant it names,
    zero, signs and extremes; every figure at the same value, and random draws), with at least 20 probes evaluated."""
    tree = parse(condition)
    names = list(dict.fromkeys(figure_names(tree)))
    grid = {-1e300, -1e6, -2.5, -1.0, 0.0, 0.3, 1.0, 1.5, 2.0, 7.0, 1e6, 1e300}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            c = float(node.value)
            grid |= {c, -c, c + max(abs(c), 1.0) * 1e-6, c - max(abs(c), 1.0) * 1e-6}
    grid = sorted(grid)
    rng = random.Random(0)
    probes = [dict.fromkeys(names, g) for g in grid]
    probes += [{n: rng.choice(grid) for n in names} for _ in range(600)]
    evaluated = 0
    for values in probes:
        try:
            result = evaluate_expression(tree, values)
        except (ArithmeticError, TypeError, ValueError):
            continue
        evaluated += 1
        if not result:
            return False
    return evaluated >= 20


def written_refusal(condition: str) -> str | None:
    """Why a condition is refused as written (``None`` when it is not): vacuous, self-compared or tautological."""
    tree = parse(condition)
    if not figure_names(tree):
        return f"refused (vacuous): condition {condition!r} reads no measured figure, so nothing can make it false"
    same = _self_compared(tree)
    if same:
        return (f"refused (self-compared): condition {condition!r} compares {same} with itself; compare a figure "
                f"with a bound or with another figure")
    if _tautological(condition):
        return (f"refused (tautological): condition {condition!r} holds whatever the figures' values, so it tests "
                f"nothing")
    return None


def bool_as_number(tree: ast.AST, values: dict) -> str | None:
    """The first boolean figure the condition uses as a number (ordered, compared with a non-boolean, in arithmetic
    or in abs/min/max), or None."""
    def boolean(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, bool) or (
            isinstance(node, (ast.Name, ast.Attribute)) and isinstance(values.get(dotted(node)), bool))

    def figure(node):
        name = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        return name if name is not None and isinstance(values.get(name), bool) else None

    for left, op, right in comparisons(tree):
        for a, b in ((left, right), (right, left)):
            if figure(a) and (op not in (ast.Eq, ast.NotEq) or not boolean(b)):
                return figure(a)
    for node in ast.walk(tree):
        operands = ([node.left, node.right] if isinstance(node, ast.BinOp) else
                    [node.operand] if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else
                    node.args if isinstance(node, ast.Call) else [])
        for a in operands:
            if figure(a):
                return figure(a)
    return None


# --- sentences ----------------------------------------------------------------------------------------------------
def word_choice(spec: str) -> tuple[str, str, str, str] | None:
    """``(op, operand, word if true, word if false)`` of a field spec ``if OP OPERAND then WORDS else WORDS``."""
    m = _CHOICE.match(spec.strip())
    if m is None:
        if spec.strip().startswith("if"):
            raise ValueError(f"format spec {spec!r}: write 'if OP OPERAND then WORDS else WORDS', e.g. "
                             f"'if >= 2 then reaches else falls short of'")
        return None
    return m.group(1), m.group(2), m.group(3), m.group(4)


def operand(token: str):
    try:
        return float(token)
    except ValueError:
        check_name(token)
        return None


def fields(text: str) -> list[tuple[str, str, str | None]]:
    return [(f, spec or "", conv) for _, f, spec, conv in string.Formatter().parse(text) if f is not None]


def render(text: str, values: dict, missing: str | None = None) -> str:
    """``text`` with each ``{area.figure:spec}`` field filled from ``values`` (name -> value): a format spec formats
    the value, ``if OP OPERAND then WORDS else WORDS`` picks the words by comparing it with a number or a figure.
    ``missing``: what a field whose figures are not in ``values`` becomes (default: ``ClaimError``)."""
    out = []
    for literal, name, spec, conv in string.Formatter().parse(text):
        out.append(literal)
        if name is None:
            continue
        picked = word_choice(spec or "")
        if missing is not None and (name not in values or picked and operand(picked[1]) is None
                                    and picked[1] not in values):
            out.append(missing)
            continue
        if name not in values:
            raise ClaimError(f"figure {name!r} is not in the figures")
        v = values[name]
        v = repr(v) if conv == "r" else str(v) if conv == "s" else v
        if picked:
            op, token, yes, no = picked
            other = operand(token)
            if other is None:
                if token not in values:
                    raise ClaimError(f"figure {token!r} is not in the figures")
                other = values[token]
            out.append(yes if COMPARE[_OPS[op]](v, other) else no)
        else:
            out.append(format(v, spec or ""))
    return "".join(out)


def wording_problems(text: str, condition: str) -> list[str]:
    """Where a claim's sentence says more or less than its condition tests (a heuristic over its literal words, the
    words a field picks from the data excepted): 'faster' needs a ratio above 1 or an ordering of two figures,
    'no faster' a bound of at most 1.0 (or 'within N%'), 'slower' a ratio under 1, 'compute-bound' an intensity
    above a measured ridge figure and 'memory-bound' one below it, 'fits' and 'fewer' an upper bound, 'reaches'
    and 'more' a lower one; their negations ('neither ... reaches', 'does not fit') the other way. Returns one message
    per problem (a claim's ``text`` and ``condition``)."""
    words = re.sub(r"\s+", " ", "".join(lit for lit, *_ in string.Formatter().parse(text)).lower())
    pairs = []
    for left, op, right in comparisons(parse(condition)):
        lc, rc = isinstance(left, ast.Constant), isinstance(right, ast.Constant)
        if rc and not lc:
            pairs.append(("const", op, right.value, left))
        elif lc and not rc:
            flip = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}.get(op, op)
            pairs.append(("const", flip, left.value, right))
        elif not lc and not rc:
            pairs.append(("figures", op, left, right))
    num = [(op, c) for kind, op, c, _ in pairs if kind == "const" and isinstance(c, (int, float))
           and not isinstance(c, bool)]
    ordered = [p for p in pairs if p[0] == "figures" and p[1] in (ast.Lt, ast.LtE, ast.Gt, ast.GtE)]
    up = any(op in (ast.Gt, ast.GtE) for op, _ in num) or bool(ordered)
    down = any(op in (ast.Lt, ast.LtE) for op, _ in num) or bool(ordered)
    problems = []
    neg = re.search(r"\b(no|not) faster\b", words)
    if neg:
        within = re.search(r"within (\d+(?:\.\d+)?)\s*%", words)
        limit = 1.0 + (float(within.group(1)) / 100 if within else 0.0)
        if not any(op in (ast.Lt, ast.LtE) and c <= limit for op, c in num):
            problems.append(f"'{neg.group(0)}' needs a bound of at most {limit:g} ('<= 1.0', or say 'within N%')")
    if re.search(r"(?<!no )(?<!not )\bfaster\b", words) and not neg:
        if not (ordered or any((op is ast.Gt and c >= 1) or (op is ast.GtE and c > 1) for op, c in num)):
            problems.append("'faster' needs a ratio above 1 ('> 1.0') or two figures ordered")
    if re.search(r"\bslower\b", words):
        if not (ordered or any((op is ast.Lt and c <= 1) or (op is ast.LtE and c < 1) for op, c in num)):
            problems.append("'slower' needs a ratio under 1 ('< 1.0') or two figures ordered")
    ridge = [(op, a, b) for kind, op, a, b in pairs if kind == "figures" and any(
        "ridge" in n or n.startswith("ceiling.") for n in figure_names(a) + figure_names(b))]
    for bound, ops in (("compute-bound", (ast.Gt, ast.GtE)), ("memory-bound", (ast.Lt, ast.LtE))):
        if bound in words:
            good = False
            for op, _, b in ridge:
                ridge_right = any("ridge" in n or n.startswith("ceiling.") for n in figure_names(b))
                if (op in ops) == ridge_right:
                    good = True
            if not good:
                problems.append(f"'{bound}' needs the intensity compared with a measured ridge figure (a bound "
                                f"typed into the condition does not follow the machine)")
    if re.search(r"\bfits?\b", words) and not re.search(r"\b(not|never) fits?\b|\bdoes not fit\b", words) \
            and not down:
        problems.append("'fits' needs an upper bound ('<' or '<=' a capacity)")
    negated = re.search(r"\b(not|never|neither|nor)\b(\W+\w+){0,3}\W+reach", words)
    if re.search(r"\breach(es)?\b(?! of\b)", words) and not re.search(r"\b(of|within|out of)(\W+\w+){0,3}\W+reach\b",
                                                                       words) and not negated and not up:
        problems.append("'reaches' needs a lower bound ('>=')")
    if negated and not down:
        problems.append(f"'{negated.group(0)}' needs an upper bound ('<')")
    if re.search(r"\b(?:does not|do not|never) fits?\b", words) and not up:
        problems.append("'does not fit' needs a lower bound ('>' a capacity)")
    if re.search(r"(?<!no )\bmore\b", words) and not up:
        problems.append("'more' needs a lower bound ('>' or two figures ordered)")
    if re.search(r"\bfewer\b", words) and not down:
        problems.append("'fewer' needs an upper bound ('<' or two figures ordered)")
    return problems
