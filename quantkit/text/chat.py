"""Chat templates rendered with bounded work: a template comes from the model file, untrusted.

A Jinja template is a program.  Jinja's sandbox keeps it away from the host (no ``_`` attributes,
no files) and stops ``range`` at 100000 items, but bounds neither sizes nor time:
``{{ 'x' * 10**10 }}`` builds a 10 GB string, a loop that doubles a string runs out of memory,
nested loops run for hours.  Here

* every value a template makes with an operator (``*``, ``+``, ``**``, ``%``, ``~``), a filter or
  a call has its size estimated *before* it is made where it can grow beyond its inputs (a
  repetition, a padding width, a replacement), and refused beyond :data:`MAX_CHARS`;
* the sizes of everything made, and the lengths of all loops, are summed against
  :data:`MAX_WORK`;
* the output is at most :data:`MAX_CHARS` characters;
* rendering stops after :data:`MAX_SECONDS`, checked at each of those steps and at the start of
  every loop (a loop's body makes a value or starts a loop, or it is short).

A template that goes beyond a limit, or fails in any other way, is a QuantkitError.  The limits are
orders of magnitude above what a chat template does for a prompt of any context length.
"""
from __future__ import annotations

import functools
import json
import re
import time

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ..errors import QuantkitError

MAX_CHARS = 1 << 24             # one value, or the whole output (characters, or items of a list)
MAX_WORK = 1 << 27              # all values made and loop items visited, together
MAX_SECONDS = 10.0
MAX_INT_BITS = 1 << 16          # an integer power beyond this many bits takes long to compute
MAX_JSON_INDENT = 64
_NUMBERS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")        # str.format's "{:{}}": a width taken from the arguments


class TemplateLimit(QuantkitError):
    """A chat template that goes beyond a limit of size or time."""


class _Budget:
    """The work of one rendering."""

    def __init__(self):
        self.work = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"chat template: rendering takes longer than {MAX_SECONDS:g} s")

    def charge(self, n: int, what: str) -> None:
        """``n`` characters (or items) about to be made by ``what``."""
        if n > MAX_CHARS:
            raise TemplateLimit(f"chat template: {what} of {n} characters or items is beyond the limit of {MAX_CHARS}")
        self.work += max(n, 0)
        if self.work > MAX_WORK:
            raise TemplateLimit(f"chat template: makes more than {MAX_WORK} characters or items in all")
        self.tick()


def _sized(x) -> bool:
    return isinstance(x, (str, list, tuple, dict, range))


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _text_size(x) -> int:
    return len(x) if isinstance(x, str) else len(str(x))


def _format_size(fmt: str, args) -> int:
    """An upper bound on the length of ``fmt`` formatted (% or str.format) with ``args``: the
    format, every number in it (widths and precisions), the arguments' texts and, where a width
    comes from the arguments (``%*d``, ``{:{}}``), the integer arguments."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    size = len(fmt) + sum(int(n) for n in _NUMBERS.findall(fmt)) + sum(_text_size(v) for v in values)
    if "*" in fmt or _NESTED_FIELD.search(fmt):
        size += sum(abs(v) for v in values if _int(v))
    return size


def _replace_size(s: str, old, new, count=-1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    n = s.count(old) if old else len(s) + 1
    if _int(count) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _str_method_size(s: str, name: str, args: tuple, kwargs: dict) -> int:
    """An upper bound on the length of ``s.name(*args, **kwargs)`` for the str methods that can
    make more than they are given; len(s) for the others (what they make is charged after)."""
    a = list(args) + list(kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill") and a and _int(a[0]):
        return max(len(s), a[0])
    if name == "expandtabs":
        tab = a[0] if a and _int(a[0]) else 8
        return len(s) + s.count("\t") * max(tab, 0)
    if name == "replace" and len(a) >= 2:
        return _replace_size(s, *a[:3])
    if name == "format":
        return _format_size(s, tuple(a))
    if name == "format_map":
        return _format_size(s, a[0] if a and isinstance(a[0], dict) else ())
    if name == "join" and a and _sized(a[0]):
        return sum(_text_size(x) for x in a[0]) + len(s) * len(a[0])
    return len(s)


def _filter_size(name: str, args: tuple, kwargs: dict) -> int | None:
    """An upper bound on what the filter ``name`` makes of ``args`` where it can be more than its
    input (padding, indentation, repetition); None for the others."""
    a = list(args) + list(kwargs.values())
    value = a[0] if a else ""
    text = value if isinstance(value, str) else ""
    if name == "center" and len(a) > 1 and _int(a[1]):
        return max(len(text), a[1])
    if name == "indent" and len(a) > 1:
        width = a[1] if _int(a[1]) else _text_size(a[1])
        return len(text) + (text.count("\n") + 1) * max(width, 0)
    if name == "replace" and len(a) >= 3:
        return _replace_size(text, *a[1:4])
    if name == "format" and isinstance(value, str):
        return _format_size(value, tuple(args[1:]) + tuple(kwargs.values()))
    if name == "join" and _sized(value):
        sep = a[1] if len(a) > 1 and isinstance(a[1], str) else ""
        return sum(_text_size(x) for x in value) + len(sep) * len(value)
    if name in ("batch", "slice") and len(a) > 1 and _int(a[1]):
        return (len(value) if _sized(value) else 0) + max(a[1], 0)
    if name == "wordwrap":
        wrap = next((x for x in a[2:] if isinstance(x, str)), "\n")
        return len(text) * (1 + len(wrap))
    return None


class _BoundLoopsAndConcat(NodeTransformer):
    """Rewrites a parsed template so that every loop's iterable goes through ``_quantkit_loop``
    and every ``~`` through ``_quantkit_concat``: calls, which the environment checks."""

    def _call(self, name: str, args: list, like: nodes.Node) -> nodes.Call:
        call = nodes.Call(nodes.Name(name, "load"), args, [], None, None)
        call.set_lineno(like.lineno)
        call.set_environment(like.environment)
        return call

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._call("_quantkit_loop", [node.iter], node)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return self._call("_quantkit_concat", list(node.nodes), node)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """A sandboxed Jinja environment set up like transformers' chat templating, with the bounds
    of this module.  :meth:`render` renders a template of it."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.budget = _Budget()
        self.globals.pop("lipsum", None)            # lipsum(n) writes n paragraphs
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            _quantkit_loop=self._loop, _quantkit_concat=self._concat)
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

    def _parse(self, source, name, filename):
        return _BoundLoopsAndConcat().visit(super()._parse(source, name, filename))

    # ---- the checks ----

    def _loop(self, iterable):
        if _sized(iterable):
            self.budget.charge(len(iterable), "a loop")
        return iterable

    def _concat(self, *parts) -> str:
        texts = [jinja2.runtime.soft_str(p) for p in parts]
        self.budget.charge(sum(len(t) for t in texts), "a ~ concatenation")
        return "".join(texts)

    def _bounded_filter(self, name: str, f):
        @functools.wraps(f)                         # keeps jinja's pass_context/... marks
        def bounded(*args, **kwargs):
            plain = args[1:] if args and isinstance(args[0], (jinja2.runtime.Context, jinja2.Environment,
                                                               jinja2.nodes.EvalContext)) else args
            size = _filter_size(name, plain, kwargs)
            if size is not None:
                self.budget.charge(size, f"the filter {name}")
            result = f(*args, **kwargs)
            if _sized(result):
                self.budget.charge(len(result), f"the filter {name}")
            return result
        return bounded

    def call_binop(self, context, operator, left, right):
        b = self.budget
        if operator == "*":
            if _sized(left) and _int(right):
                b.charge(len(left) * right, "a repetition")
            elif _int(left) and _sized(right):
                b.charge(len(right) * left, "a repetition")
        elif operator == "**" and _int(left) and _int(right) and abs(left) > 1 and right > 0:
            if abs(left).bit_length() * right > MAX_INT_BITS:
                raise TemplateLimit(f"chat template: the power {left} ** {right} is beyond {MAX_INT_BITS} bits")
        elif operator == "+" and _sized(left) and _sized(right):
            b.charge(len(left) + len(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            b.charge(_format_size(left, right), "a % formatting")
        b.tick()
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        b = __self.budget
        b.tick()
        method = getattr(__obj, "__wrapped__", __obj)   # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            b.charge(_str_method_size(owner, getattr(method, "__name__", ""), args, kwargs),
                     f"str.{getattr(method, '__name__', '?')}")
        result = super().call(__context, __obj, *args, **kwargs)
        if _sized(result):
            b.charge(len(result), "a call's result")
        return result

    # ---- rendering ----

    def render(self, template: jinja2.Template, **variables) -> str:
        """``template`` (from this environment) rendered: a QuantkitError for any failure."""
        self.budget = _Budget()
        out, size = [], 0
        try:
            for piece in template.generate(**variables):
                size += len(piece)
                if size > MAX_CHARS:
                    raise TemplateLimit(f"chat template: the output is longer than {MAX_CHARS} characters")
                self.budget.tick()
                out.append(piece)
        except QuantkitError:
            raise
        except jinja2.TemplateError as e:
            raise QuantkitError(f"chat template: {e}") from None
        except Exception as e:                      # the template is the file's code: any failure is the file's
            raise QuantkitError(f"chat template: {type(e).__name__}: {e}") from None
        return "".join(out)

    def compile_template(self, source: str) -> jinja2.Template:
        try:
            return self.from_string(source)
        except jinja2.TemplateError as e:
            raise QuantkitError(f"chat template: {e}") from None
        except Exception as e:
            raise QuantkitError(f"chat template: {type(e).__name__}: {e}") from None


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if indent is not None and (_int(indent) and indent > MAX_JSON_INDENT
                               or isinstance(indent, str) and len(indent) > MAX_JSON_INDENT):
        raise TemplateLimit(f"chat template: a JSON indent beyond {MAX_JSON_INDENT} characters")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    import datetime
    return datetime.datetime.now().strftime(fmt)
