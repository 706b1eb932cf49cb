"""Metrics: namespaced scalars to `<workdir>/metrics.jsonl` and TensorBoard, a console line, a bar.

Names are namespaced by what they measure: `learning/*` (loss, grad_norm, lr), `eval/*` (loss,
perplexity), `perf/*` (step time, tokens/s, TFLOP/s, MFU) and, in streamed engines, `io/*`.
One JSON object per logged step: `{"step": 10, "learning/loss": 2.31, ...}`.
"""

import json
import math
import os
import pathlib

import tensorboardX
import tqdm

def format_console_line(step: int, total: int, scalars: dict) -> str:
  """e.g. 'step 120/600 | loss 2.3456 | grad_norm 0.812 | lr 2.99e-03 | 12,345 tok/s | 0.166 s/step'."""
  parts = [f'step {step}/{total}']
  if 'learning/loss' in scalars:
    parts.append(f'loss {scalars["learning/loss"]:.4f}')
  if 'learning/grad_norm' in scalars:
    parts.append(f'grad_norm {scalars["learning/grad_norm"]:.3f}')
  if 'learning/lr' in scalars:
    parts.append(f'lr {scalars["learning/lr"]:.2e}')
  if 'eval/loss' in scalars:
    parts.append(f'eval_loss {scalars["eval/loss"]:.4f} | eval_ppl {scalars["eval/perplexity"]:.2f}')
  if 'perf/tokens_per_sec' in scalars:
    parts.append(f'{scalars["perf/tokens_per_sec"]:,.0f} tok/s')
  if 'perf/step_time_s' in scalars:
    parts.append(f'{scalars["perf/step_time_s"]:.3f} s/step')
  if 'perf/mfu' in scalars:
    parts.append(f'mfu {100 * scalars["perf/mfu"]:.1f}%')
  return ' | '.join(parts)


class MetricsWriter:
  """Writes metric rows; owns the progress bar. Use as a context manager."""

  def __init__(self, workdir: pathlib.Path, *, total_steps: int, start_step: int,
               progress_bar: bool = True):
    self.jsonl_path = pathlib.Path(workdir) / 'metrics.jsonl'
    self.total_steps = total_steps
    # Rows up to the resumed checkpoint's step were written before it was saved; any later ones
    # (and, on a fresh start, all of them: a killed first attempt's step-0 eval) are redone.
    self._drop_rows_after(start_step if start_step else -1)
    self._jsonl = open(self.jsonl_path, 'a', encoding='utf-8')
    self._tensorboard = tensorboardX.SummaryWriter(str(pathlib.Path(workdir) / 'tensorboard'))
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True,
                          disable=not progress_bar, leave=True)

  def _drop_rows_after(self, step: int) -> None:
    """On resume, forget rows a killed run logged after its last checkpoint (they get redone)."""
    if not self.jsonl_path.exists():
      return
    with open(self.jsonl_path, encoding='utf-8') as f:
      rows = [line for line in f if line.strip() and _row_step(line) is not None]
    kept = [line for line in rows if _row_step(line) <= step]
    tmp = self.jsonl_path.with_suffix('.jsonl.tmp')
    with open(tmp, 'w', encoding='utf-8') as f:
      f.writelines(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.jsonl_path)

  def write(self, step: int, scalars: dict, console: bool = True) -> None:
    row = {'step': step, **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + '\n')
    self._jsonl.flush()
    for name, value in row.items():
      if name != 'step' and math.isfinite(value):
        self._tensorboard.add_scalar(name, value, step)
    if console:
      self.print(format_console_line(step, self.total_steps, scalars))

  def advance(self, steps: int = 1, loss: float | None = None) -> None:
    if loss is not None:
      self._bar.set_postfix(loss=f'{loss:.4f}', refresh=False)
    self._bar.update(steps)

  def print(self, line: str) -> None:
    """A console line that does not break the progress bar."""
    tqdm.tqdm.write(line)

  def close(self) -> None:
    self._bar.close()
    self._jsonl.close()
    self._tensorboard.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _row_step(line: str):
  try:
    return int(json.loads(line)['step'])
  except (ValueError, KeyError, TypeError):
    return None  # a torn last line from a killed run
