"""The code keeps the shape issue 15 gave it: layers enforced by import-linter, short functions
and lines, and a streamed step that reads as its stages."""

import ast
import pathlib
import shutil
import subprocess

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'megatrain_jax'
MAX_FUNCTION_LINES = 60
MAX_TRAIN_STEP_LINES = 30
MAX_LINE_CHARS = 100


def _functions():
  for path in sorted(PACKAGE.rglob('*.py')):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield path.relative_to(PACKAGE.parent), node


def test_no_function_is_longer_than_60_lines():
  long = [f'{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)'
          for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
  assert not long, 'split these functions:\n' + '\n'.join(long)


def test_no_line_of_the_product_is_longer_than_100_characters():
  """The package, launch.py and configs/ (what users read and the next engineer edits); tests and
  bench scripts are exempt."""
  root = PACKAGE.parent
  files = [*PACKAGE.rglob('*.py'), root / 'launch.py', *(root / 'configs').glob('*.py')]
  long = [f'{path.relative_to(root)}:{number} ({len(line)} characters)'
          for path in sorted(files)
          for number, line in enumerate(path.read_text().splitlines(), 1)
          if len(line) > MAX_LINE_CHARS]
  assert not long, 'rewrap these lines:\n' + '\n'.join(long)


def test_streamed_train_step_reads_as_its_stages():
  (step,) = [node for path, node in _functions()
             if path.name == 'streamed.py' and node.name == 'train_step']
  assert step.end_lineno - step.lineno + 1 <= MAX_TRAIN_STEP_LINES
  calls = sorted((n.lineno, n.col_offset, n.func.attr) for n in ast.walk(step)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute))
  called = [name for _, _, name in calls]
  stages = ['_embed', '_forward', '_head', '_backward', '_embed_backward', '_update_outer']
  assert [c for c in called if c in stages] == stages  # once each, in the schedule's order


def test_imports_follow_the_layers():
  """The layers contract in pyproject.toml (import-linter, from requirements-dev.txt)."""
  assert shutil.which('lint-imports'), 'pip install -r requirements-dev.txt (import-linter)'
  result = subprocess.run(['lint-imports'], cwd=PACKAGE.parent, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
