"""Chat templates from others, run safely: jinja2's immutable sandbox in the environment
transformers' apply_chat_template gives templates, and a budget on what a rendering may make.

A chat template comes with a downloaded checkpoint (tokenizer_config.json, chat_template.jinja),
so it is untrusted code. jinja2's sandbox keeps it from Python's internals but not from
exhausting memory: '{{ "a" * 10**10 }}', `' '|center(10**9)`, a list of one string repeated and
joined, '%1000000000s' % x each built a 1-10 GB value before the rendering's length could be
checked. Here every value a template makes (binary operators, filters, str methods, `~`,
`{{ ... }}`, macro and block bodies, ranges) is sized from its arguments before it is made, and
refused (TemplateRefused) where it would be beyond the render's budget: at most RENDER_SLACK plus
RENDER_FACTOR times the record's own characters (`record_budget`), so a template renders what a
record needs and no template can take more than a few MB of a record's share.

`render(template, budget, **variables)` is the one entry: data/documents.py renders each
conversation through it and turns a refusal into a bad record.
"""

import contextvars
import functools
import json
import operator
import re
import string
from collections.abc import Iterator, MappingView, Sized
from typing import Any


# What a chat template may make of a record: values (characters, list items, bytes of a number)
# and output of at most RENDER_SLACK plus RENDER_FACTOR times the record's own size, and ranges
# of that many items in all. jinja2's sandbox bounds none of them ('{{ "a" * 10**10 }}' took
# 13.5 GB; nested range loops ran until killed).
RENDER_SLACK = 1 << 20
RENDER_FACTOR = 4
# What a rendering may make in all, its values summed, as a multiple of its budget: a loop that
# grows a value by `+` makes each value within the budget but their sum quadratic (a million
# iterations over a 1 MB string ran for hours); real templates make a few times the record.
WORK_FACTOR = 64
# [limit, range items left, characters (or items) it may still make]
_BUDGET = contextvars.ContextVar('render_budget', default=None)
_BINOPS = {'+': operator.add, '*': operator.mul, '**': operator.pow, '%': operator.mod}


class TemplateRefused(ValueError):
  """A template refused or failed on one rendering; the message names why."""


def record_budget(*values) -> int:
  """Characters (or items) a rendering of `values` (a record's messages, tools) may make."""
  return RENDER_SLACK + RENDER_FACTOR * sum(len(str(v)) for v in values)


def render(template: str, budget: int, **variables) -> str:
  """`template` rendered with `variables` in the sandbox, within `budget` (`record_budget`).

  Raises:
    TemplateRefused: for a value or an output beyond the budget, raise_exception, or any error
      jinja2 raises (UndefinedError, SecurityError, ...), named.
  """
  token = _BUDGET.set([budget, budget, WORK_FACTOR * budget])
  try:
    pieces, size = [], 0
    for piece in compiled(template).generate(**variables):
      size += len(piece)
      if size > budget:
        raise TemplateRefused(f'chat template: renders more than {budget:,} characters of this '
                              'record')
      pieces.append(piece)
    return ''.join(pieces)
  except TemplateRefused:
    raise
  except Exception as e:  # jinja2 raises many kinds (UndefinedError, SecurityError, ...)
    raise TemplateRefused(f'chat template failed on this record: {type(e).__name__}: {e}') from e
  finally:
    _BUDGET.reset(token)


_TEMPLATES: dict[str, Any] = {}  # template text -> its compiled program


def compiled(template: str):
  """The chat template compiled in jinja2's immutable sandbox, in the environment transformers'
  apply_chat_template gives it (`_environment`)."""
  program = _TEMPLATES.get(template)
  if program is None:
    program = _TEMPLATES[template] = _environment().from_string(template)
  return program


@functools.cache
def _environment():
  """transformers' chat template environment (chat_template_utils), less `strftime_now` (the
  date would differ between prepares; Llama 3's templates then use their own fixed date): the
  immutable sandbox with trim_blocks and lstrip_blocks; `{% break %}`/`{% continue %}`;
  `{% generation %}` blocks (transformers' assistant tracker; here their body renders as is);
  its tojson; raise_exception; and its guarded `dict` and `namespace` (no underscore names)."""
  # pylint: disable=g-import-not-at-top  (only chat data needs jinja2)
  import jinja2
  from jinja2 import ext, nodes, sandbox

  class Generation(ext.Extension):
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument  (jinja2's own trick)
      self, attrs = args[0], dict(*args[1:], **kwargs)
      for name in attrs:
        Namespace.check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace.check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
      if isinstance(name, str) and name.startswith('_'):
        raise TemplateRefused(f'chat template: a namespace may not hold {name!r} (underscore '
                              'names)')

  def raise_exception(message):
    raise TemplateRefused(f'chat template: {message}')

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = _sized_environment_class()(trim_blocks=True, lstrip_blocks=True,
                                   extensions=[Generation, ext.loopcontrols])
  env.filters['tojson'] = tojson
  for name, size_of in _FILTER_SIZES.items():
    env.filters[name] = _sized_filter(name, env.filters[name], size_of)
  env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                     dict=lambda *args, **kwargs: dict(*args, **kwargs), range=_counted_range)
  env.intercepted_binops, env.call_binop = frozenset(_BINOPS), _sized_binop
  # Every {{ value }} is shown (str) only once its size is known; the text a macro, call or
  # {% set %} block gathers is joined only where it fits.
  env.finalize, env.concat = _sized_output, _sized_concat
  return env


def _sized_environment_class():
  """jinja2's immutable sandbox whose method calls ('x'.center(n), .format, .join, ...) and
  `~` (joins of values shown as text) are refused where their value would exceed the budget."""
  # pylint: disable=g-import-not-at-top  (only chat data needs jinja2)
  from jinja2 import compiler, sandbox

  class Generator(compiler.CodeGenerator):
    @compiler.optimizeconst
    def visit_Concat(self, node, frame):  # jinja2's own writes str_join((...)), unbounded
      self.write('environment.sized_join((')
      for arg in node.nodes:
        self.visit(arg, frame)
        self.write(', ')
      self.write('))')

  class Environment(sandbox.ImmutableSandboxedEnvironment):
    code_generator_class = Generator

    def call(self, context, obj, /, *args, **kwargs):
      if getattr(obj, '__name__', None) == 'join' and args and not isinstance(args[0], Sized):
        args = (list(args[0]), *args[1:])  # a generator is counted, then joined, once
      _refuse_over(f'.{getattr(obj, "__name__", "?")}()', _method_size(obj, args, kwargs))
      return super().call(context, obj, *args, **kwargs)

    @staticmethod
    def sized_join(values):
      _refuse_over('~', _items_size(values))
      return ''.join(map(str, values))

  return Environment


def _budget() -> list[int]:
  return _BUDGET.get() or [RENDER_SLACK, RENDER_SLACK, WORK_FACTOR * RENDER_SLACK]


def _refuse_over(what: str, size: int) -> None:
  """Raises TemplateRefused where `what` would make a value of `size` beyond the render's budget,
  or more than WORK_FACTOR times it with the values made so far."""
  budget = _BUDGET.get() or _budget()
  if size > RENDER_SLACK and size > budget[0]:  # every budget holds RENDER_SLACK
    raise TemplateRefused(f'chat template: {what} would make a value of {size:,} characters (or '
                          f'items), more than this record may render to ({budget[0]:,})')
  budget[2] -= size
  if budget[2] < 0:
    raise TemplateRefused(f'chat template: makes more than {WORK_FACTOR * budget[0]:,} '
                          f'characters (or items) in all while rendering this record, '
                          f'{WORK_FACTOR}x what it may render to (a loop that grows a value?)')


def _sized_binop(context, op: str, left, right):
  """A template's +, *, ** and % (the sandbox's intercepted binops), refused where the value
  would be larger than the render's budget allows."""
  del context
  if op == '+' and type(left) is str and type(right) is str:  # most of them: sized inline
    _refuse_over(op, len(left) + len(right))
    return left + right
  _refuse_over(op, _binop_size(op, left, right))
  return _BINOPS[op](left, right)


def _binop_size(op: str, left, right) -> int:
  """About the size of `left op right` (characters, items, bytes of an int), from its operands."""
  def size(value):
    if isinstance(value, (str, bytes, list, tuple)):
      return len(value)
    return value.bit_length() // 8 if isinstance(value, int) else 0
  if op == '*':
    for sequence, times in ((left, right), (right, left)):
      if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(times, int):
        return len(sequence) * max(times, 0)
  if op == '**':
    return left.bit_length() * right // 8 if (isinstance(left, int) and isinstance(right, int)
                                              and right > 0) else 0
  if op == '%' and isinstance(left, str):  # printf-style formatting: '%1000000000s' % x
    return _format_size(left, right, braces=False)
  return size(left) + size(right)


def _counted_range(*args):
  """jinja2's sandboxed range, its items counted against the render's budget."""
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
  items, budget = sandbox.safe_range(*args), _budget()
  budget[1] -= len(items)
  if budget[1] < 0:
    raise TemplateRefused(f'chat template: its ranges hold more than {budget[0]:,} items in all, '
                          'more than this record may need')
  return items


def _shown_size(value, indent: int = 0, sep: int = 0) -> int:
  """About len(str(value)) (json.dumps's with `indent` and separators of `sep` characters),
  counted without making it, and no further than the render's budget: a list of one string
  repeated ([s] * 1000) is small as items but shows as a thousand copies."""
  if type(value) is str:  # pylint: disable=unidiomatic-typecheck  (most values: at once)
    return len(value)
  from jinja2.utils import Namespace  # pylint: disable=g-import-not-at-top
  limit, size, stack = _budget()[0], 0, [(value, 0)]
  while stack and size <= limit:
    value, depth = stack.pop()
    if isinstance(value, Namespace):
      value = value._Namespace__attrs  # pylint: disable=protected-access  (its repr shows them)
    if isinstance(value, str):
      size += len(value) + (2 if depth else 0)  # quoted inside a container
    elif isinstance(value, bytes):
      size += 4 * len(value) + 3
    elif isinstance(value, int) and not isinstance(value, bool):
      size += value.bit_length() // 3 + 2
    elif isinstance(value, (dict, list, tuple, set, frozenset, MappingView)):
      size += 2 + len(value) * (2 + sep + indent * (depth + 1))
      if size <= limit:
        children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children)
    else:  # None, a float, a jinja2 loop or macro: a few characters
      size += 32
  return size


def _items_size(items) -> int:
  """About the length of `items` shown one after another (a join's), counted as _shown_size."""
  size, limit = 0, _budget()[0]
  for item in items:
    size += _shown_size(item)
    if size > limit:
      break
  return size


def _int(value) -> int:
  return value if isinstance(value, int) else 0


def _format_size(text: str, values, braces: bool) -> int:
  """About the length of `text` formatted with `values` (str.format's fields where `braces`,
  else printf's %): every field as wide as its widest width or precision, argument or (where a
  width is an argument: '*', '{:{}}') integer argument."""
  values = list(values.values() if isinstance(values, dict) else
                values if isinstance(values, (tuple, list)) else [values])
  if braces:
    try:
      specs = [spec or '' for _, field, spec, _ in string.Formatter().parse(text)
               if field is not None]
    except ValueError:  # str.format names the error itself
      return 0
    widths_given = any('{' in spec for spec in specs)
  else:
    specs = re.findall(r'%(?:\([^)]*\))?[-#0 +]*(?:\*|\d*)(?:\.(?:\*|\d*))?', text)
    widths_given = any('*' in spec for spec in specs)
  widest = max([int(n) for spec in specs for n in re.findall(r'\d+', spec)] +
               [_items_size([v]) for v in values] +
               [_int(v) for v in values if widths_given] + [0])
  return len(text) + len(specs) * widest


def _replace_size(text, old, new, count=None) -> int:
  """About the length of text.replace(old, new, count)."""
  if not (isinstance(old, str) and isinstance(new, str)) or _shown_size(text) > _budget()[0]:
    return _shown_size(text)
  text = str(text)
  times = text.count(old) if not isinstance(count, int) or count < 0 else min(
      count, text.count(old))
  return len(text) + times * max(0, len(new) - len(old))


def _method_size(method, args, kwargs) -> int:
  """About the length of the value a str method call would make (0 for other calls)."""
  method = getattr(method, '__wrapped__', method)  # the sandbox's wrapper of str.format
  text, name = getattr(method, '__self__', None), getattr(method, '__name__', '')
  if not isinstance(text, str):
    return 0
  width = _int(args[0] if args else next(iter(kwargs.values()), 0))
  if name in ('center', 'ljust', 'rjust', 'zfill'):
    return max(len(text), width)
  if name == 'expandtabs':
    return len(text) * max(width, 1)
  if name == 'join' and args:
    return _items_size(args[0]) + len(text) * len(args[0])
  if name == 'replace' and len(args) >= 2:
    return _replace_size(text, *args[:3])
  if name in ('format', 'format_map'):
    return _format_size(text, [*args, *kwargs.values()], braces=True)
  if name == 'translate' and args and isinstance(args[0], dict):
    return len(text) * max([_shown_size(v) for v in args[0].values()] + [1])
  return 0


def _lines(text) -> int:
  return text.count('\n') + 1 if isinstance(text, str) else _shown_size(text)


def _width(width) -> int:
  return len(width) if isinstance(width, str) else _int(width)


# The filters that show their input as text, sized as it is: a string's is its length.
_TEXT_FILTERS = frozenset(('string', 'upper', 'lower', 'title', 'capitalize', 'trim',
                           'striptags', 'escape', 'e', 'forceescape', 'truncate', 'wordcount',
                           'urlencode', 'xmlattr'))

# The filters whose value may be far larger than their input ('x'|center(10**10), a list of one
# string repeated, joined), each with the size of the value it would make, from its arguments
# (named as jinja2's filters name them); those that show their input as text (upper, escape,
# ...) are counted as that text.
_FILTER_SIZES = {
    'center': lambda value, width=80: max(_shown_size(value), _int(width)),
    'indent': lambda s, width=4, first=False, blank=False: (
        _shown_size(s) + _lines(s) * _width(width)),
    'join': lambda value, d='', attribute=None: (
        _items_size(value) + len(value) * (len(d) if isinstance(d, str) else 0)),
    'format': lambda value, *args, **kwargs: _format_size(value, kwargs or args, braces=False),
    'wordwrap': lambda s, width=79, break_long_words=True, wrapstring=None, **_: (
        _shown_size(s) + (_shown_size(s) // max(_int(width), 1) + _lines(s) + str(s).count(' '))
        * len(wrapstring or '\n')),
    'replace': _replace_size,
    'pprint': lambda value: _shown_size(value, indent=1),
    'tojson': lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        _shown_size(x, indent=_width(indent), sep=sum(map(len, separators or ())))),
    'batch': lambda value, linecount, fill_with=None: _shown_size(value) + (
        0 if fill_with is None else _int(linecount) * (2 + _shown_size(fill_with))),
    'slice': lambda value, slices, fill_with=None: _shown_size(value) + _int(slices) * (
        2 + (0 if fill_with is None else _shown_size(fill_with))),
    'sum': lambda iterable, attribute=None, start=0: (
        0 if isinstance(start, (int, float)) else _shown_size(start) + _items_size(iterable)),
    'urlize': lambda value, trim_url_limit=None, nofollow=False, target=None, rel=None, **_: (
        3 * _shown_size(value) + (str(value).count(' ') + _lines(value)) * (
            64 + _width(target or '') + _width(rel or ''))),
    **{name: lambda value, *_, **__: _shown_size(value) for name in _TEXT_FILTERS},
}


def _sized_filter(name: str, apply, size_of):
  """Filter `apply`, refused where `size_of` its arguments is beyond the render's budget."""
  from jinja2.utils import _PassArg  # pylint: disable=g-import-not-at-top
  skip = 0 if _PassArg.from_obj(apply) is None else 1  # the environment or context first

  textual = name in _TEXT_FILTERS

  @functools.wraps(apply)  # keeps jinja2's pass_environment / pass_eval_context marks
  def sized(*args, **kwargs):
    if textual and len(args) > skip and type(args[skip]) is str:  # most calls: sized inline
      _refuse_over(f'the filter {name!r}', len(args[skip]))
      return apply(*args, **kwargs)
    args = list(args)
    if len(args) > skip and isinstance(args[skip], Iterator):
      args[skip] = list(args[skip])  # a generator is counted, then filtered, once
    try:
      size = size_of(*args[skip:], **kwargs)
    except (TypeError, ValueError, AttributeError):  # bad arguments: the filter names them
      size = 0
    _refuse_over(f'the filter {name!r}', size)
    return apply(*args, **kwargs)
  return sized


def _sized_output(value):
  """The value of a {{ ... }}, refused where it would show as more than the budget."""
  _refuse_over('{{ ... }}', len(value) if type(value) is str else _shown_size(value))
  return value


def _sized_concat(pieces) -> str:
  """The text a macro, call or {% set %} block gathers, refused where it is beyond the budget."""
  pieces = list(pieces)
  _refuse_over('a macro or block', sum(map(len, pieces)))
  return ''.join(pieces)
