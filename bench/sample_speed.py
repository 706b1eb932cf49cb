"""How fast `launch.py --sample` writes tokens: `sample.generate` on a random model.

    python bench/sample_speed.py [--rounds 3] [--baseline OTHER_CHECKOUT] [--d_model 512]
        [--layers 8] [--vocab 32000] [--prompt 64] [--new 192] [--json out.json]

Each round starts a fresh interpreter per checkout (this one, and with --baseline, e.g. a `git
worktree` of an older commit, that one; alternating which goes first) that builds a Llama-shaped
model of the given size (GQA 8 query / 2 key-value heads of 64 features, d_ff = 2.75 d_model,
random weights), calls `generate` once (it compiles for the buffer's length, then runs), then
times a second, identical call: a greedy continuation of a random prompt by --new tokens with no
stop id, so every call writes the same number of tokens. Reported: the first call's seconds and
the second's, its tokens per second (medians over the rounds), and the ratio to the baseline
measured in the same rounds.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = '''
import json, sys, time
import jax, numpy as np
from megatrain_jax import model as model_lib
from megatrain_jax import sample
d_model, layers, vocab, prompt_len, new = (int(a) for a in sys.argv[1:6])
cfg = model_lib.ModelConfig(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=8,
                            num_kv_heads=2, head_dim=64, d_ff=int(2.75 * d_model),
                            max_seq_len=prompt_len + new, tie_embeddings=False)
params = model_lib.init_params(cfg, jax.random.key(0))
prompt = np.random.default_rng(0).integers(1, vocab, prompt_len)
started = time.perf_counter()
first = sample.generate(cfg, params, prompt, max_new_tokens=new, eos_id=-1)
first_call = time.perf_counter() - started
started = time.perf_counter()
ids = sample.generate(cfg, params, prompt, max_new_tokens=new, eos_id=-1)
seconds = time.perf_counter() - started
assert ids.size == new and (ids == first).all()
print(json.dumps({'first_call_s': first_call, 'seconds': seconds,
                  'tokens_per_s': new / seconds, 'params': cfg.num_params,
                  'first_tokens': ids[:8].tolist()}))
'''


def _run(tree: pathlib.Path, args) -> dict:
  env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS='cpu')
  shape = [str(v) for v in (args.d_model, args.layers, args.vocab, args.prompt, args.new)]
  out = subprocess.run([sys.executable, '-c', _CHILD, *shape], env=env, capture_output=True,
                       text=True, check=True, cwd=tree)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--baseline', default=None, help='another checkout, measured alongside')
  parser.add_argument('--d_model', type=int, default=512)
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--vocab', type=int, default=32000)
  parser.add_argument('--prompt', type=int, default=64, help='prompt tokens')
  parser.add_argument('--new', type=int, default=192, help='tokens written')
  parser.add_argument('--json', default=None)
  args = parser.parse_args()
  trees = {'this': REPO_ROOT}
  if args.baseline:
    trees['baseline'] = pathlib.Path(args.baseline).resolve()
  results = {name: [] for name in trees}
  for round_ in range(args.rounds):
    order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
    for name in order:
      results[name].append(_run(trees[name], args))
      print(f'round {round_ + 1} {name}: {results[name][-1]}', flush=True)
  tokens = {name: [r['first_tokens'] for r in rows] for name, rows in results.items()}
  if len({json.dumps(t) for t in tokens.values()}) > 1:
    print(f'note: the checkouts wrote different tokens: {tokens}')
  print(f'\nmodel: {results["this"][0]["params"]:,} params, prompt {args.prompt} + {args.new} '
        'new tokens, greedy')
  print('| checkout | first call s (compiles) | s per call | tokens/s |\n|---|---:|---:|---:|')
  medians = {}
  for name, rows in results.items():
    medians[name] = {key: statistics.median(r[key] for r in rows)
                     for key in ('first_call_s', 'seconds', 'tokens_per_s')}
    m = medians[name]
    print(f'| {name} | {m["first_call_s"]:.2f} | {m["seconds"]:.2f} | {m["tokens_per_s"]:.1f} |')
  if 'baseline' in medians:
    ratios = [a['tokens_per_s'] / b['tokens_per_s']
              for a, b in zip(results['this'], results['baseline'])]
    print(f'tokens/s this / baseline, per round: {", ".join(f"{r:.2f}" for r in ratios)}')
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({'args': vars(args), 'results': results},
                                                  indent=1))


if __name__ == '__main__':
  main()
