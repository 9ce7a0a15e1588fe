"""The tool registry and the built-in tools, `calculator` and `python`.

A tool is `fn(arguments, **params) -> str`: `arguments` is what the model wrote (the text inside
`name(...)` of a tag call, or a JSON call's arguments object), `params` come from the job's
`env.tools` entry and the model cannot set them; the string returned is what the model is shown.
Tools are found like rewards: registered in this process (`@rlplatform.envs.tool("name")`), by
import path (`fn: package.module:function`), or from installed packages' `rlplatform.tools` entry points.
"""

from __future__ import annotations

import ast
import operator
from typing import Callable, Dict, List

from rlplatform.config import ToolSpec
from rlplatform.rewards.code_sandbox import run_in_sandbox
from rlplatform.user_code import entry_points_of, import_callable
from rlplatform.transport.tool_queue import Arguments

ENTRY_POINT_GROUP = "rlplatform.tools"
TOOLS: Dict[str, Callable] = {}


class ToolSpecError(ValueError):
    """A job's tool entry that cannot be used: unknown name or bad import path."""


def tool(name: str) -> Callable[[Callable], Callable]:
    """Decorator: `@rlplatform.envs.tool("search")` registers the function under that name."""
    def decorate(fn: Callable) -> Callable:
        TOOLS[name] = fn
        return fn
    return decorate


def find_tool(spec: ToolSpec) -> Callable:
    """The function a job's tool entry names: registered first, then entry points, or its import path."""
    if spec.fn:
        return import_callable(spec.fn, "tool", ToolSpecError)
    if spec.name in TOOLS:
        return TOOLS[spec.name]
    point = entry_points_of(ENTRY_POINT_GROUP).get(spec.name)
    if point is None:
        known = sorted(set(TOOLS) | set(entry_points_of(ENTRY_POINT_GROUP)))
        raise ToolSpecError(f"unknown tool '{spec.name}'; known: {', '.join(known)}")
    return point.load()


def resolve_tools(specs: List[ToolSpec]) -> Dict[str, Callable]:
    """The job's tools by the name the model calls them, each bound to its params."""
    bound = {}
    for i, spec in enumerate(specs):
        try:
            fn = find_tool(spec)
        except ToolSpecError as err:
            raise ToolSpecError(f"env.tools[{i}]: {err}") from None
        bound[spec.label] = _bind(fn, spec.params)
    return bound


def _bind(fn: Callable, params: Dict) -> Callable[[Arguments], str]:
    return lambda arguments: fn(arguments, **params)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 100  # `2**10**9` would run for ever: larger exponents are refused
MAX_DIGITS = 1000  # operands and results longer than this are refused


@tool("calculator")
def calculator(arguments: Arguments) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary signs and parentheses.
    Parsed, never evaluated as code; anything else raises ValueError naming what was refused."""
    expression = arguments.get("expression", "") if isinstance(arguments, dict) else arguments
    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        value = _OPERATORS[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return value
    raise ValueError(f"not allowed in a calculator expression: {ast.unparse(node)!r}")


@tool("python")
def python(arguments: Arguments, *, timeout_s: float = 5.0, memory_mb: int = 512,
           allow_weak_isolation: bool = False) -> str:
    """What a Python program prints, run in the code sandbox (`rewards.code_sandbox`), or why it failed.
    arguments: the program (or a JSON call's {"code": ...}). The params are the sandbox's limits."""
    code = arguments.get("code", "") if isinstance(arguments, dict) else arguments
    result = run_in_sandbox(str(code), "", timeout_s=timeout_s, memory_mb=memory_mb,
                            allow_weak_isolation=allow_weak_isolation)
    if result.passed:
        return result.stdout_tail
    return f"{result.stdout_tail}{result.stderr_tail}error: {result.reason}"
