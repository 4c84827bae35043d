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
                elif name == "guards_code":
                    for guard in inner if isinstance(inner, list) else [inner]:
                        if not _safe_guard(guard):
                            return (f"a guards_code entry {str(guard)[:80]!r} that is not a plain check of input "
                                    "sizes (ExportedProgram.module() executes it as Python)")
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
    return None


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
                "math": frozenset(name for name in dir(math) if not name.startswith("_"))}
_TENSOR_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "numel", "shape"})
_KEY = re.compile(r"[A-Za-z0-9_]*")
_OPERATORS = (ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.expr_context)


def _parse(text: Any) -> ast.AST | None:
    if not isinstance(text, str) or len(text) > 100_000:
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
