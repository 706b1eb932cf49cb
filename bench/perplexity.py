"""WikiText-2 test perplexity with `launch.py --eval`, and its time per 1k tokens.

  PYTHONPATH=. python bench/perplexity.py [--workdir /tmp/ppl] [--steps 300] [--max_len 128]
  PYTHONPATH=. python bench/perplexity.py --from_hf /models/Llama-3.2-1B --max_len 1024

Without --from_hf, a small checkpoint is made first: the default model (3M params, byte-level) is
trained for --steps steps on WikiText-2 *validation* text (../shared/data/wikitext-2/valid.txt;
the shared data has no train split), then evaluated on the test text. With --from_hf the
Hugging Face checkpoint is evaluated as it is, with its own tokenizer. Each evaluation runs in a
fresh `launch.py --eval` process, once with stride = max_len (no overlap) and once with
stride = max_len / 2; the time per 1k tokens is the evaluator's own (compile included), the wall
time the whole process's. Prints a table and a JSON line per evaluation.
"""

import argparse
import json
import math
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / 'shared' / 'data' / 'wikitext-2'


def launch(*args: str) -> str:
  result = subprocess.run([sys.executable, 'launch.py', *args], cwd=REPO, capture_output=True,
                          text=True)
  if result.returncode:
    raise SystemExit(f'launch.py {" ".join(args)} failed:\n{result.stderr[-3000:]}')
  return result.stdout


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', default='/tmp/ppl')
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--max_len', type=int, default=128)
  parser.add_argument('--from_hf', default='')
  args = parser.parse_args()
  workdir = pathlib.Path(args.workdir)
  common = ['--config.train.progress_bar=false', f'--workdir={workdir}']
  model = ([f'--config.init.from_hf={args.from_hf}'] if args.from_hf else [])
  if not args.from_hf:
    shutil.rmtree(workdir, ignore_errors=True)
    started = time.perf_counter()
    launch(*common, f'--config.data.path={WIKITEXT / "valid.txt"}',
           f'--config.train.steps={args.steps}', '--config.train.eval_every=0')
    print(f'trained {args.steps} steps on wikitext-2 valid.txt in '
          f'{time.perf_counter() - started:.0f} s', flush=True)
  print(f'\n{"stride":>8}{"tokens":>10}{"loss":>10}{"ppl":>10}{"bits/token":>12}'
        f'{"s / 1k tok":>12}{"wall s":>8}')
  for stride in (args.max_len, args.max_len // 2):
    started = time.perf_counter()
    launch('--eval', *common, *model, f'--config.eval.path={WIKITEXT / "test.txt"}',
           f'--config.eval.max_len={args.max_len}', f'--config.eval.stride={stride}')
    wall = time.perf_counter() - started
    result = json.loads((workdir / 'eval.json').read_text())
    print(f'{stride:>8}{result["eval/tokens"]:>10}{result["eval/loss"]:>10.4f}'
          f'{result["eval/perplexity"]:>10.3f}{result["eval/loss"] / math.log(2):>12.4f}'
          f'{result["eval/seconds_per_1k_tokens"]:>12.4f}{wall:>8.1f}', flush=True)
    print(json.dumps({**result, 'wall_s': wall}))


if __name__ == '__main__':
  main()
