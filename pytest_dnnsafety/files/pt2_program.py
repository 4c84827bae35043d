"""Code in a ``torch.export`` program's JSON and example inputs: what torch would run, refused.

The program JSON (``models/<model>.json``) is not pickled, yet torch 2.13 turns parts of it into
Python that it runs:

* every ``expr_str`` goes through :func:`sympy.sympify`, which is ``eval``
  (``torch/_export/serde/serialize.py``, ``_parse_sym_expr``), while ``torch.export.load`` runs;
* every ``guards_code`` string is pasted into a function that ``ExportedProgram.module()``
  ``exec`` s and the model calls on every forward (``torch/export/_unlift.py``,
  ``_convert_guards_code_to_fn``);
* names become Python source when the graph module is generated (``torch/fx/graph.py``): a
  placeholder's name is written raw into ``def forward(self, ...)``, a parameter's dotted name
  into ``getattr(self, "...")``, the ``in_spec``'s keyword names into ``{'...': ...}``;
* the example inputs' dict keys are pasted into the guard's message string;
* every node ``target`` is resolved by ``getattr`` from ``torch``, ``operator`` or ``math``
  (``deserialize_operator``) and any callable it reaches becomes a ``call_function`` node that
  the model calls on every forward: ``"torch.os.system"`` would do.

Plain arithmetic is a hazard too: ``sympy.sympify("10**10**10")`` computes for hours, and so would a
guard ``math.factorial(10**9) > 0`` on every forward pass. Shape expressions and guards are therefore
bounded before sympy or ``exec`` sees them (:func:`_bound_problem`: literal exponents of at most
128, no value over 65,536 bits, bounded length, depth and size).

:func:`program_problem` therefore admits names made of letters, digits and ``_.:+-`` and a space,
shape expressions built only from whitelisted sympy calls, and guards built only from input
sizes, arithmetic and whitelisted functions, and node targets that resolve to a registered
operator (``torch.ops.<namespace>.<op>.<overload>``, a higher-order operator) or to one of the
symbolic-size functions torch itself serializes; :func:`example_inputs_problem` admits the same
plain keys. Free text that torch keeps as metadata (stack traces, module stacks, string arguments,
which it writes with ``repr``) is not restricted.

Used by :mod:`.pt2_archive` and :mod:`.loading`; no pytest import.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

__all__ = ["program_problem", "example_inputs_problem"]

#: Keys whose strings torch keeps as node metadata or writes with ``repr``: never code.
_FREE_TEXT = frozenset({"metadata", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node",
                        "custom", "torch_version", "as_string", "as_strings"})
_PLAIN_EXTRA = frozenset("_.:+- ")


def _plain(text: str) -> bool:
    """Letters, digits and ``_.:+-`` and a space: nothing that can end a name or a string in Python source."""
    return all(char.isalnum() or char in _PLAIN_EXTRA for char in text) and text.isprintable()


def program_problem(program: Any) -> str | None:
    """Why torch would run code from a program JSON document, or None when it would not."""
    stack: list[tuple[Any, str]] = [(program, "top-level")]
    while stack:
        value, key = stack.pop()
        if isinstance(value, dict):
            for name, inner in value.items():
                if not _plain(name):
                    return f"a key {name[:80]!r} that is not a plain name (torch writes names into Python code)"
                if name in _FREE_TEXT:
                    continue
                if name == "expr_str":
                    if not _safe_expression(inner):
                        return (f"an expr_str {str(inner)[:80]!r} that is not a plain shape expression "
                                "(torch evaluates it with sympy.sympify, which is eval)")
                    too_much = _bound_problem(inner, guard=False)
                    if too_much:
                        return (f"an expr_str {str(inner)[:80]!r} with {too_much} (sympy.sympify would compute "
                                "it while torch.export.load runs, for hours)")
                elif name == "guards_code":
                    for guard in inner if isinstance(inner, list) else [inner]:
                        if not _safe_guard(guard):
                            return (f"a guards_code entry {str(guard)[:80]!r} that is not a plain check of input "
                                    "sizes (ExportedProgram.module() executes it as Python)")
                        too_much = _bound_problem(guard, guard=True)
                        if too_much:
                            return (f"a guards_code entry {str(guard)[:80]!r} with {too_much} (the model would "
                                    "compute it on every forward pass, for hours)")
                elif name == "target":
                    problem = _target_problem(inner)
                    if problem:
                        return problem
                elif name in ("in_spec", "out_spec"):
                    problem = _spec_problem(inner)
                    if problem:
                        return f"an {name} {problem}"
                else:
                    stack.append((inner, name))
        elif isinstance(value, list):
            stack.extend((item, key) for item in value)
        elif isinstance(value, str) and not _plain(value):
            return (f"a {key} value {value[:80]!r} that is not a plain name (torch writes names into the Python "
                    "code it generates for the model)")
    return _node_arithmetic_problem(program)


_TARGET = re.compile(r"(torch|_operator|math)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
#: ``torch.ops`` attributes that are not operator namespaces (``torch.ops.load_library`` loads native code).
_OPS_NON_NAMESPACES = frozenset({"import_module", "load_library", "loaded_libraries"})
#: The plain functions torch's export verifier admits as node targets (``torch/_export/verifier.py``),
#: less ``torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch``, which imports a
#: module named by a string argument and calls its ``apply``.
_VERIFIED_FUNCTIONS = (
    "torch.autograd.grad_mode.set_grad_enabled", "torch._C._set_grad_enabled", "torch.sym_int", "torch.sym_float",
    "torch.sym_ite", "torch.sym_max", "torch.sym_min", "torch.sym_not", "torch.sym_sqrt", "torch.sym_sum",
    "torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast",
    "torch.fx.experimental.symbolic_shapes.cast_symbool_to_symint_guardless",
    *(f"torch._functorch.predispatch.{name}" for name in (
        "_add_batch_dim", "_remove_batch_dim", "_vmap_increment_nesting", "_vmap_decrement_nesting",
        "lazy_load_decompositions", "_make_dual", "_unpack_dual", "_jvp_increment_nesting",
        "_jvp_decrement_nesting", "_unwrap_for_grad", "_enter_dual_level", "_exit_dual_level")),
)
_ALLOWED_CALLABLES: list[Any] = []


def _allowed_callables() -> list[Any]:
    """The non-operator targets admitted: the verifier's builtins and functions, torch's symbolic ops."""
    if not _ALLOWED_CALLABLES:
        import importlib

        from torch._export.verifier import Verifier

        found: list[Any] = list(Verifier().allowed_builtin_ops())
        try:
            from torch._export.serde.serialize import _SYM_OPS

            found += list(_SYM_OPS)
        except ImportError:  # pragma: no cover - a torch without it serializes none of these
            pass
        for path in _VERIFIED_FUNCTIONS:
            module, _, name = path.rpartition(".")
            try:
                found.append(getattr(importlib.import_module(module), name))
            except (ImportError, AttributeError):  # pragma: no cover - not in this torch version
                continue
        _ALLOWED_CALLABLES.extend(found)
    return _ALLOWED_CALLABLES


def _target_problem(target: Any) -> str | None:
    """Why a node target would make the model call something other than an operator, or None.

    Resolved as ``deserialize_operator`` resolves it (attribute lookups only, nothing is called),
    and admitted only when it reaches a registered ``OpOverload``, a higher-order operator or
    one of the plain functions that torch's own export verifier admits (see
    :data:`_VERIFIED_FUNCTIONS`).
    """
    import operator

    import torch

    text = str(target)[:80]
    match = _TARGET.fullmatch(target) if isinstance(target, str) else None
    names = match.group(2)[1:].split(".") if match else []
    if (match is None or any(name.startswith("__") for name in names)
            or (match.group(1) == "torch" and names[0] == "ops"
                and (len(names) < 3 or names[1] in _OPS_NON_NAMESPACES))):
        return (f"a node target {text!r} that is not an operator (torch.ops.<namespace>.<op>.<overload>); "
                "the model would call it on every forward")
    resolved: Any = {"torch": torch, "_operator": operator, "math": math}[match.group(1)]
    for name in names:
        try:
            resolved = getattr(resolved, name)
        except Exception:  # torch.export.load would keep the string and then fail on it
            return f"a node target {text!r} that names no operator registered in this process"
    if isinstance(resolved, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return None
    if any(resolved is allowed for allowed in _allowed_callables()):
        return None
    return (f"a node target {text!r} that resolves to a {type(resolved).__name__}, not an operator; the model "
            "would call it on every forward")


def _spec_problem(text: Any) -> str | None:
    """Why a serialized pytree spec (JSON inside a JSON string) holds more than plain names."""
    if text is None or text == "":
        return None
    try:
        spec = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        spec = None
    if spec is None:
        return f"{str(text)[:80]!r} that is not a serialized pytree spec"
    stack: list[Any] = [spec]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for name, inner in value.items():
                if not _plain(name):
                    return f"key {name[:80]!r} that is not a plain name"
                if name == "context" and isinstance(inner, str):
                    try:
                        stack.append(json.loads(inner))  # a dict's keys, serialized once more
                    except (ValueError, RecursionError):
                        return f"context {inner[:80]!r} that is not JSON"
                else:
                    stack.append(inner)
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and not _plain(value):
            return f"name {value[:80]!r} that is not a plain name (torch writes it into Python code)"
    return None


def example_inputs_problem(example_inputs: Any) -> str | None:
    """Why the keys of a program's example inputs would become code in its guards, or None."""
    from torch.utils import _pytree as pytree

    try:
        leaves = pytree.tree_leaves_with_path(example_inputs)
    except Exception as exc:  # a structure pytree cannot walk: torch's own guard code would fail on it
        return f"example inputs that torch cannot flatten ({type(exc).__name__})"
    for path, _ in leaves:
        for entry in path:
            if isinstance(entry, pytree.SequenceKey):
                continue
            key = entry.key if isinstance(entry, pytree.MappingKey) else getattr(entry, "name", entry)
            if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and _plain(key))):
                return (f"an example input key {str(key)[:80]!r} that is not a plain name (torch pastes the keys "
                        "into the Python code of the input guards)")
    return None


#: Callables a shape expression (``expr_str``, printed by ``sympy.srepr``) may name.
_SYMPY_CALLS = frozenset({
    "Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "Eq", "Ne",
    "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
    "Unequality", "And", "Or", "Not", "Xor", "Piecewise", "ExprCondPair", "Tuple", "floor", "ceiling", "sqrt",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt",
    "IsNonOverlappingAndDenseIndicator", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "BitwiseFn_bitwise_and",
    "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor",
})
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "int_oo", "pi", "E"})
#: Callables that take a literal string (a symbol name or a number), which they do not parse as code.
_STRING_CALLS = {"Symbol": re.compile(r"[A-Za-z_][A-Za-z0-9_]*"),
                 "Float": re.compile(r"[0-9.eE+\-]+|[+\-]?(?:inf|nan)"),
                 "Integer": re.compile(r"[+\-]?[0-9]+"), "Rational": re.compile(r"[+\-]?[0-9]+(?:/[0-9]+)?")}
#: Names a guard (``guards_code``, Python that ``ExportedProgram.module()`` executes) may use.
_GUARD_NAMES = frozenset({"L", "math", "torch", "inf", "abs", "max", "min", "int", "float", "round", "bool",
                          "cast_symbool_to_symint_guardless"}) | _SYMPY_CALLS - {"Symbol", "Tuple"}
_GUARD_ATTRS = {"torch": frozenset({"sym_float", "sym_int", "sym_max", "sym_min", "sym_sqrt", "_sym_sqrt", "sym_ite",
                                    "sym_not", "sym_sum"}),
                "math": frozenset({"floor", "ceil", "trunc", "sqrt", "isqrt", "log", "log2", "log10", "log1p", "exp",
                                   "expm1", "pow", "fabs", "fmod", "copysign", "remainder", "gcd", "cos", "cosh",
                                   "acos", "acosh", "sin", "sinh", "asin", "asinh", "tan", "tanh", "atan", "atan2",
                                   "atanh", "hypot", "isinf", "isnan", "isfinite", "inf", "nan", "pi", "e", "tau"})}
_TENSOR_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "numel", "shape"})
_KEY = re.compile(r"[A-Za-z0-9_]*")
_OPERATORS = (ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.expr_context)


def _parse(text: Any) -> ast.AST | None:
    if not isinstance(text, str) or len(text) > _MAX_LENGTH:
        return None
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _safe_expression(text: Any) -> bool:
    """Whether ``sympy.sympify(text)`` can only build a shape expression: whitelisted calls, no attributes."""
    tree = _parse(text)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS):
                return False
            pattern = _STRING_CALLS.get(node.func.id)
            for index, arg in enumerate(node.args):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if index or pattern is None or not pattern.fullmatch(arg.value):
                        return False
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str) and not _KEY.fullmatch(node.value.replace(".", "").replace("-", "")
                                                                  .replace("+", "").replace("/", "")):
                return False
            if not isinstance(node.value, (str, int, float, bool)) and node.value is not None:
                return False
        elif isinstance(node, ast.Name):
            if not (node.id in _SYMPY_CALLS or node.id in _SYMPY_NAMES
                    or re.fullmatch(r"[a-z]{1,4}[0-9]+", node.id)):
                return False
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.keyword,
                                   *_OPERATORS)):
            return False
    return True


def _safe_guard(text: Any) -> bool:
    """Whether a guard is a comparison of input sizes: allowed names, calls and attributes only."""
    tree = _parse(text)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in _GUARD_NAMES:
                return False
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            allowed = _GUARD_ATTRS.get(base, _TENSOR_ATTRS) if base in _GUARD_ATTRS else _TENSOR_ATTRS
            if node.attr not in allowed or (base is not None and base not in _GUARD_ATTRS):
                return False
        elif isinstance(node, ast.Call):
            if node.keywords or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return False
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str) and not _KEY.fullmatch(node.value):
                return False
            if not isinstance(node.value, (str, int, float, bool)) and node.value is not None:
                return False
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Subscript,
                                   *_OPERATORS)):
            return False
    return True


# ------------------------------------------------------------------ what an expression may compute
#
# sympy.sympify("10**10**10") and a guard "math.factorial(10**9) > 0" are plain arithmetic that
# runs for hours. Before sympy (or the guard's exec) sees an expression, _bound_problem follows
# the magnitude of every value it can compute, in bits of |log2| (so a reciprocal counts as much
# as its number): an input size or symbol is at most 64 bits, a sum one bit more than its
# largest term, a product or quotient the sum of its factors; a power or shift needs a literal
# exponent of at most _MAX_EXPONENT; no value may pass _MAX_BITS (a 20,000-digit integer, which
# Python computes in microseconds; a shape never needs more than 64 bits). Length, nesting
# depth, node count and the arguments of one Max/Min are bounded as well.

_MAX_LENGTH = 20_000
_MAX_DEPTH = 100
_MAX_NODES = 5_000
_MAX_ARGS = 64
_MAX_BITS = 1 << 16
_MAX_EXPONENT = 128
_MAX_LITERAL_BITS = 1_024
_SIZE_BITS = 64
_POWERS = frozenset({"Pow", "PowByNatural", "FloatPow", "pow"})
_SHIFTS = frozenset({"LShift"})
_NUMBER_CALLS = frozenset({"Integer", "Float", "Rational"})


class _TooLarge(Exception):
    """What an expression would compute beyond the bounds."""


def _bound_problem(text: Any, guard: bool) -> str | None:
    """Why evaluating ``text`` could compute too much, or None (call after the whitelist check)."""
    tree = _parse(text)
    if tree is None:
        return f"an expression that does not parse or is longer than {_MAX_LENGTH} characters"
    count = sum(1 for _ in ast.walk(tree))
    if count > _MAX_NODES:
        return f"{count} terms (at most {_MAX_NODES})"
    try:
        _bits(tree, 0)
    except _TooLarge as exc:
        return str(exc)
    except RecursionError:
        return f"terms nested deeper than {_MAX_DEPTH}"
    return None


def _literal(node: ast.AST) -> float | None:
    """The value of a literal number (``2``, ``-1``, ``0.5``, ``Integer(2)``, ``Rational(1, 2)``), or None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value) if abs(node.value) < 1e300 else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _NUMBER_CALLS
            and not node.keywords and 1 <= len(node.args) <= 2):
        try:
            values = [float(arg.value) if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                      else _literal(arg) for arg in node.args]
        except (ValueError, OverflowError):
            return None
        if any(value is None or not math.isfinite(value) for value in values):
            return None
        return values[0] / values[1] if len(values) == 2 and values[1] else values[0]
    return None


def _number_bits(value: Any) -> int:
    """|log2| of a literal number in bits, generously rounded up; refused past the literal bound."""
    if isinstance(value, bool) or value is None:
        return 1
    if isinstance(value, int):
        bits = abs(value).bit_length()
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _TooLarge(f"the literal {value!r} (an infinite or undefined number)")
        bits = abs(math.frexp(value)[1]) + 54
    else:  # a numeric string of Integer/Float/Rational: its digits and decimal exponent
        text = str(value)
        mantissa, _, exponent = text.lower().partition("e")
        digits = sum(char.isdigit() for char in mantissa)
        try:
            scale = abs(int(exponent)) if exponent else 0
        except ValueError:
            scale = _MAX_LITERAL_BITS
        bits = int((digits + scale) * 3.33) + 2 if len(text) < 400 else _MAX_LITERAL_BITS + 1
    if bits > _MAX_LITERAL_BITS:
        raise _TooLarge(f"a literal number of about {bits} bits (at most {_MAX_LITERAL_BITS})")
    return bits


def _check(bits: int) -> int:
    if bits > _MAX_BITS:
        raise _TooLarge(f"a value of up to {bits} bits (at most {_MAX_BITS}: a shape never needs more than 64)")
    return bits


def _power(base: ast.AST, exponent: ast.AST, depth: int) -> int:
    value = _literal(exponent)
    if value is None:
        raise _TooLarge(f"a power or shift whose exponent {ast.unparse(exponent)[:40]!r} is not a literal number")
    if abs(value) > _MAX_EXPONENT:
        raise _TooLarge(f"a power or shift with exponent {ast.unparse(exponent)[:40]!r} (at most {_MAX_EXPONENT})")
    return _check(max(1, _bits(base, depth)) * max(1, math.ceil(abs(value))))


def _bits(node: ast.AST, depth: int) -> int:
    """An upper bound of the magnitude (|log2|, in bits) of every value evaluating ``node`` computes."""
    if depth > _MAX_DEPTH:
        raise _TooLarge(f"terms nested deeper than {_MAX_DEPTH}")
    depth += 1
    if isinstance(node, ast.Expression):
        return _bits(node.body, depth)
    if isinstance(node, ast.Constant):
        return 0 if isinstance(node.value, str) else _number_bits(node.value)
    if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
        return _SIZE_BITS  # a symbol, an input size, a constant such as math.inf
    if isinstance(node, ast.UnaryOp):
        return _check(_bits(node.operand, depth) + 1)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            return _power(node.left, node.right, depth)
        if isinstance(node.op, ast.LShift):
            return _check(_bits(node.left, depth) + _power(ast.Constant(2), node.right, depth))
        left, right = _bits(node.left, depth), _bits(node.right, depth)
        if isinstance(node.op, (ast.Mult, ast.Div, ast.FloorDiv)):
            return _check(left + right)
        return _check(max(left, right) + 1)
    if isinstance(node, (ast.Compare, ast.BoolOp)):
        values = [node.left, *node.comparators] if isinstance(node, ast.Compare) else node.values
        return _check(max(_bits(value, depth) for value in values))
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if len(node.args) > _MAX_ARGS:
            raise _TooLarge(f"a call of {name} with {len(node.args)} arguments (at most {_MAX_ARGS})")
        if isinstance(node.func, ast.Name) and name in _NUMBER_CALLS:
            return max([1, *(_number_bits(arg.value) if isinstance(arg, ast.Constant) else _bits(arg, depth)
                             for arg in node.args)]) * len(node.args)
        if name in _POWERS and len(node.args) == 2:
            return _power(node.args[0], node.args[1], depth)
        if name in _SHIFTS and len(node.args) == 2:
            return _check(_bits(node.args[0], depth) + _power(ast.Constant(2), node.args[1], depth))
        values = [*node.args, *(keyword.value for keyword in node.keywords)]
        inner = _bits(node.func.value, depth) if isinstance(node.func, ast.Attribute) else 0
        if name == "Mul":
            return _check(sum(_bits(value, depth) for value in values))
        return _check(max([inner, _SIZE_BITS, *(_bits(value, depth) for value in values)]) + len(values))
    raise _TooLarge(f"a {type(node).__name__} term")


#: Node targets whose Python arithmetic on symbolic sizes the model runs on every forward pass.
_NODE_ARITHMETIC = {"_operator.pow": "pow", "_operator.lshift": "shift", "_operator.mul": "mul"}
_NODE_ARITHMETIC.update({f"_operator.{name}": "other" for name in (
    "add", "sub", "floordiv", "truediv", "mod", "neg", "rshift", "abs")})


def _node_arithmetic_problem(program: Any) -> str | None:
    """Why a graph's symbolic-size nodes (``pw = 10 ** 1000000000``) could compute for hours, or None.

    The same bounds as :func:`_bound_problem`, followed through the graph: every node value is
    bounded from its inputs (a size or an unknown symbol: 64 bits).
    """
    bits: dict[str, int] = {}
    stack: list[Any] = [program]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            nodes = value.get("nodes")
            for node in nodes if isinstance(nodes, list) else ():
                problem = _node_problem(node, bits) if isinstance(node, dict) else None
                if problem:
                    return problem
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return None


def _arg_bits(arg: Any, bits: dict[str, int]) -> int:
    if isinstance(arg, dict):
        if isinstance(arg.get("as_int"), int):
            return abs(arg["as_int"]).bit_length()
        for key in ("as_sym_int", "as_sym_float"):
            inner = arg.get(key)
            if isinstance(inner, dict) and isinstance(inner.get("as_name"), str):
                return bits.get(inner["as_name"], _SIZE_BITS)
    return _SIZE_BITS


def _node_problem(node: dict[str, Any], bits: dict[str, int]) -> str | None:
    kind = _NODE_ARITHMETIC.get(node.get("target"))  # type: ignore[arg-type]
    if kind is None:
        return None
    args = [entry.get("arg") for entry in node.get("inputs") or () if isinstance(entry, dict)]
    sizes = [_arg_bits(arg, bits) for arg in args] or [_SIZE_BITS]
    name = str(node.get("name"))[:40]
    if kind in ("pow", "shift"):
        exponent = args[1] if len(args) == 2 and isinstance(args[1], dict) else {}
        literal = exponent.get("as_int", exponent.get("as_float"))
        if isinstance(literal, bool) or not isinstance(literal, (int, float)) or not abs(literal) <= _MAX_EXPONENT:
            shown = str(literal if literal is not None else exponent)[:40]
            return (f"a node {name!r} ({node['target']}) whose exponent {shown} is not a literal number of at most "
                    f"{_MAX_EXPONENT} (the model would compute it on every forward pass, for hours)")
        result = sizes[0] * max(1, math.ceil(abs(literal))) if kind == "pow" else sizes[0] + int(abs(literal))
    else:
        result = sum(sizes) if kind == "mul" else max(sizes) + 1
    if result > _MAX_BITS:
        return (f"a node {name!r} ({node['target']}) computing a value of up to {result} bits (at most {_MAX_BITS}; "
                "the model would compute it on every forward pass)")
    for output in node.get("outputs") or ():
        inner = output.get("as_sym_int") if isinstance(output, dict) else None
        if isinstance(inner, dict) and isinstance(inner.get("as_name"), str):
            bits[inner["as_name"]] = result
    return None
