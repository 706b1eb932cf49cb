"""The documentation holds together (issue 14): README.md is a front page of at most 15,000
characters whose test command is the one CI runs, every relative link in README.md and docs/*.md
reaches an existing file (and heading, for `#anchor` links into Markdown, with GitHub's slugs),
docs/README.md lists every page, and every test docs/bad-input.md names exists in tests/.

Plain text processing only (no jax, no subprocess): well under a second.
"""

import ast
import pathlib
import re
import unicodedata
import urllib.parse

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
README = REPO_ROOT / 'README.md'
DOCS = REPO_ROOT / 'docs'
TESTS = REPO_ROOT / 'tests'
CI_RUN = REPO_ROOT / '.ci' / 'run'
BAD_INPUT = DOCS / 'bad-input.md'
PAGES = [README, *sorted(DOCS.glob('*.md'))]
README_MAX_CHARS = 15_000

_FENCE = re.compile(r'^\s*(```|~~~)')
_CODE_SPAN = re.compile(r'(`+)(.+?)\1')
# [text](target "title"), text possibly holding one level of brackets; images too.
_LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+"[^"]*")?\s*\)')
_HEADING = re.compile(r'^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$')
_HTML_ANCHOR = re.compile(r'<a\s+(?:name|id)="([^"]+)"')
_SCHEME = re.compile(r'^[a-zA-Z][a-zA-Z0-9+.-]*:')


def _relative(path: pathlib.Path) -> str:
  return str(path.relative_to(REPO_ROOT))


def _prose_lines(text: str) -> list[tuple[int, str]]:
  """(line number, line) of the lines outside fenced code blocks."""
  lines, fenced = [], False
  for number, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      lines.append((number, line))
  return lines


def _code_lines(text: str) -> list[str]:
  """The lines inside fenced code blocks."""
  lines, fenced = [], False
  for line in text.splitlines():
    if _FENCE.match(line):
      fenced = not fenced
    elif fenced:
      lines.append(line)
  return lines


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: its rendered text lower-cased, every character but letters,
  digits, marks, '_', '-' and spaces dropped, spaces turned into '-'."""
  text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
  text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', text)  # a link's text
  text = re.sub(r'<[^>]+>', '', text).strip().lower()     # inline HTML
  kept = ''.join(c for c in text
                 if c in ' -_' or unicodedata.category(c)[0] in 'LMN')
  return kept.replace(' ', '-')


def anchors(path: pathlib.Path) -> set[str]:
  """Every anchor a Markdown file offers: heading slugs (repeats numbered -1, -2, ... as on
  GitHub) and explicit <a name/id> anchors."""
  found, seen = set(), {}
  for _, line in _prose_lines(path.read_text(encoding='utf-8')):
    found.update(_HTML_ANCHOR.findall(line))
    match = _HEADING.match(line)
    if not match:
      continue
    base = slug(match.group(2))
    count = seen.get(base, 0)
    seen[base] = count + 1
    found.add(base if count == 0 else f'{base}-{count}')
  return found


def links(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line number, target) of every link in the prose of a Markdown file (not in code)."""
  out = []
  for number, line in _prose_lines(path.read_text(encoding='utf-8')):
    line = _CODE_SPAN.sub('code', line)  # `[a](b)` inside code is not a link
    out.extend((number, target) for target in _LINK.findall(line))
  return out


def _broken(page: pathlib.Path, target: str) -> str | None:
  """Why a relative link from `page` does not resolve, or None when it does."""
  if not target or _SCHEME.match(target):  # http:, https:, mailto:: not checked here
    return None
  path_part, _, anchor = target.partition('#')
  destination = (page.parent / urllib.parse.unquote(path_part)).resolve() if path_part else page
  if not destination.is_relative_to(REPO_ROOT):
    return f'{target}: points outside the repository'
  if not destination.exists():
    return f'{target}: no such file {destination}'
  if anchor and destination.suffix == '.md' and anchor not in anchors(destination):
    return (f'{target}: {_relative(destination)} has no heading with anchor #{anchor} '
            f'(anchors: {", ".join(sorted(anchors(destination)))})')
  return None


# ------------------------------------------------------------------------------------------------


def test_readme_is_at_most_15000_characters():
  size = len(README.read_text(encoding='utf-8'))
  assert size <= README_MAX_CHARS, (
      f'README.md has {size:,} characters (limit {README_MAX_CHARS:,}): move detail into docs/.')


@pytest.mark.parametrize('page', PAGES, ids=_relative)
def test_relative_links_resolve(page):
  problems = [f'{_relative(page)}:{number}: {why}' for number, target in links(page)
              if (why := _broken(page, target)) is not None]
  assert not problems, '\n'.join(problems)


def test_docs_index_lists_every_page():
  index = DOCS / 'README.md'
  listed = {(index.parent / target.partition('#')[0]).resolve() for _, target in links(index)}
  missing = [p.name for p in DOCS.glob('*.md') if p != index and p.resolve() not in listed]
  assert not missing, f'docs/README.md does not link to: {", ".join(sorted(missing))}'


def test_readme_test_command_is_the_one_ci_runs():
  """CI (.ci/run) runs the README's test command verbatim: the two must not drift apart."""
  ci = [line.strip() for line in CI_RUN.read_text(encoding='utf-8').splitlines()
        if 'pytest' in line and not line.lstrip().startswith('#')]
  readme = [line.strip() for line in _code_lines(README.read_text(encoding='utf-8'))
            if 'pytest' in line]
  assert len(ci) == 1, f'.ci/run should hold one pytest command, found {ci}'
  assert readme == ci, f'README.md test command(s) {readme} != .ci/run {ci}'


# --- docs/bad-input.md: every test it names exists ---------------------------------------------


def _test_names(path: pathlib.Path) -> set[str]:
  """Names of the test functions (module level and in classes) of a test file."""
  tree = ast.parse(path.read_text(encoding='utf-8'))
  return {node.name for node in ast.walk(tree)
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
          and node.name.startswith('test')}


def _sources_for_ids(path: pathlib.Path) -> str:
  """The test file's text plus that of the modules it imports from (megatrain_jax, helpers):
  where a parametrized case id is written as a string literal."""
  text = path.read_text(encoding='utf-8')
  sources = [text]
  for module in re.findall(r'^(?:from|import)\s+([\w.]+)', text, re.M):
    if module == 'helpers':
      candidates = [TESTS / 'helpers.py']
    elif module.startswith('megatrain_jax'):
      base = REPO_ROOT / module.replace('.', '/')
      candidates = [base.with_suffix('.py'), base / '__init__.py']
    else:
      continue
    sources += [c.read_text(encoding='utf-8') for c in candidates if c.is_file()]
  return '\n'.join(sources)


def bad_input_references() -> list[tuple[str, str, str, str | None]]:
  """(table row, test file, test name, case id or None) for every test the bad-input table names.

  The Test cell lists comma-separated references: `test_file.py::test_name[case]`; a bare
  `test_name[case]` or `test_name` is in the file named before it in the cell, and a bare
  `[case]` is another case of the test named before it. A parenthesised note, e.g.
  (`model.d_model`), names no test. A row of a section (bold first cell, the rest empty) names
  none; any other row must name one, or say "same test" (the row above's).
  """
  refs = []
  rows = [line for line in BAD_INPUT.read_text(encoding='utf-8').splitlines()
          if line.startswith('|')]
  header = [c.strip() for c in rows[0].strip().strip('|').split('|')]
  assert header[-1] == 'Test', f'the last column of the bad-input table is {header[-1]!r}'
  for row in rows[2:]:
    cells = [c.strip() for c in re.split(r'(?<!\\)\|', row.strip())[1:-1]]
    cell = re.sub(r'\([^()]*\)', '', cells[-1])
    if not cell:
      assert cells[0].startswith('**') and not any(cells[1:]), (
          f'bad-input.md row names no test: {row}')
      continue
    if cell == 'same test':
      continue
    file = name = None
    tokens = re.findall(r'`([^`]+)`', cell)
    assert tokens, f'bad-input.md row names no test: {row}'
    for token in tokens:
      match = re.fullmatch(r'(?:(test_\w+\.py)::)?(test_\w+)?(?:\[(.+)\])?', token)
      assert match and any(match.groups()), f'bad-input.md: not a test reference: {token!r}'
      file = match.group(1) or file
      name = match.group(2) or name
      assert file and name, f'bad-input.md: {token!r} does not say which file or test: {row}'
      refs.append((row, file, name, match.group(3)))
  return refs


def test_every_test_named_in_bad_input_exists():
  references = bad_input_references()
  assert len(references) > 50, 'the bad-input table should name its tests'
  names, sources, missing = {}, {}, []
  for row, file, name, case in references:
    path = TESTS / file
    if not path.is_file():
      missing.append(f'{file}: no such test file (row: {row[:80]}...)')
      continue
    if file not in names:
      names[file], sources[file] = _test_names(path), _sources_for_ids(path)
    if name not in names[file]:
      missing.append(f'{file}::{name}: no such test (row: {row[:80]}...)')
    elif case is not None and f"'{case}'" not in sources[file] and f'"{case}"' not in sources[file]:
      missing.append(f'{file}::{name}[{case}]: no case id {case!r} in {file} or what it imports')
  assert not missing, '\n'.join(missing)


def test_slugs_follow_github():
  assert slug('Planner projection: 7B-405B on one H100 / H200 (issue 5)') == (
      'planner-projection-7b-405b-on-one-h100--h200-issue-5')
  assert slug('Perplexity: `--eval`') == 'perplexity---eval'
  assert slug('The NVMe tier') == 'the-nvme-tier'
