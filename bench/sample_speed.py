"""How fast `launch.py --sample` writes tokens: `sample.generate` on a random model.

    python bench/sample_speed.py [--rounds 3] [--baseline OTHER_CHECKOUT] [--d_model 512]
        [--layers 8] [--vocab 32000] [--prompt 64] [--new 192] [--json out.json]
        [--temperature 0.8 --top_k 50 --top_p 0.9]
    python bench/sample_speed.py --batch_sizes 1,8,16 [--prompts 16] [--new 128]

Each round starts a fresh interpreter per checkout (this one, and with --baseline, e.g. a `git
worktree` of an older commit, that one; alternating which goes first) that builds a Llama-shaped
model of the given size (GQA 8 query / 2 key-value heads of 64 features, d_ff = 2.75 d_model,
random weights), calls `generate` once (it compiles for the buffer's length, then runs), then
times a second, identical call: a greedy continuation of a random prompt by --new tokens with no
stop id, so every call writes the same number of tokens (with --temperature > 0 the tokens are
drawn, filtered by --top_k / --top_p, with the same seed in both calls). Reported: the first
call's seconds and
the second's, its tokens per second (medians over the rounds), and the ratio to the baseline
measured in the same rounds.

With --batch_sizes (this checkout only, one process): `generate_all` of --prompts random prompts
of 16-63 tokens (greedy, no stop id, --new tokens each) at each sample.batch_size, each size
compiled by a first call on its first batch, then timed: tokens per second and the ratio to the
first size.
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
drawn = dict(temperature=float(sys.argv[6]), top_k=int(sys.argv[7]), top_p=float(sys.argv[8]))
cfg = model_lib.ModelConfig(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=8,
                            num_kv_heads=2, head_dim=64, d_ff=int(2.75 * d_model),
                            max_seq_len=prompt_len + new, tie_embeddings=False)
params = model_lib.init_params(cfg, jax.random.key(0))
prompt = np.random.default_rng(0).integers(1, vocab, prompt_len)
started = time.perf_counter()
first = sample.generate(cfg, params, prompt, max_new_tokens=new, eos_id=-1, **drawn)
first_call = time.perf_counter() - started
started = time.perf_counter()
ids = sample.generate(cfg, params, prompt, max_new_tokens=new, eos_id=-1, **drawn)
seconds = time.perf_counter() - started
assert ids.size == new and (ids == first).all()
print(json.dumps({'first_call_s': first_call, 'seconds': seconds,
                  'tokens_per_s': new / seconds, 'params': cfg.num_params,
                  'first_tokens': ids[:8].tolist()}))
'''


_BATCHED_CHILD = '''
import json, sys, time
import jax, numpy as np
from megatrain_jax import model as model_lib
from megatrain_jax import sample
d_model, layers, vocab, count, new = (int(a) for a in sys.argv[1:6])
cfg = model_lib.ModelConfig(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=8,
                            num_kv_heads=2, head_dim=64, d_ff=int(2.75 * d_model),
                            max_seq_len=64 + new, tie_embeddings=False)
params = model_lib.init_params(cfg, jax.random.key(0))
rng = np.random.default_rng(0)
prompts = [rng.integers(1, vocab, int(n)) for n in rng.integers(16, 64, count)]
want = None
for size in (int(b) for b in sys.argv[6].split(',')):
  sample.generate_all(cfg, params, prompts[:size], max_new_tokens=new, eos_id=-1,
                      batch_size=size)
  started = time.perf_counter()
  out = sample.generate_all(cfg, params, prompts, max_new_tokens=new, eos_id=-1,
                            batch_size=size)
  seconds = time.perf_counter() - started
  same = want is None or all((a == b).all() for a, b in zip(out, want))
  want = want or out
  print(json.dumps({'batch_size': size, 'seconds': seconds, 'params': cfg.num_params,
                    'tokens_per_s': sum(o.size for o in out) / seconds, 'same_tokens': same}))
'''


def _batched(args) -> None:
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS='cpu')
  shape = [str(v) for v in (args.d_model, args.layers, args.vocab, args.prompts, args.new)]
  out = subprocess.run([sys.executable, '-c', _BATCHED_CHILD, *shape, args.batch_sizes],
                       env=env, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
  rows = [json.loads(line) for line in out.stdout.strip().splitlines()]
  print(f'model: {rows[0]["params"]:,} params; {args.prompts} prompts of 16-63 tokens + '
        f'{args.new} new tokens each, greedy')
  print('| sample.batch_size | s | tokens/s | x batch size 1st | same tokens |\n'
        '|---:|---:|---:|---:|---|')
  for row in rows:
    print(f'| {row["batch_size"]} | {row["seconds"]:.2f} | {row["tokens_per_s"]:.1f} | '
          f'{row["tokens_per_s"] / rows[0]["tokens_per_s"]:.2f} | {row["same_tokens"]} |')


def _run(tree: pathlib.Path, args) -> dict:
  env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS='cpu')
  shape = [str(v) for v in (args.d_model, args.layers, args.vocab, args.prompt, args.new,
                            args.temperature, args.top_k, args.top_p)]
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
  parser.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
  parser.add_argument('--top_k', type=int, default=0)
  parser.add_argument('--top_p', type=float, default=1.0)
  parser.add_argument('--batch_sizes', default='', help='e.g. 1,8,16: generate_all batching')
  parser.add_argument('--prompts', type=int, default=16, help='prompts, with --batch_sizes')
  args = parser.parse_args()
  if args.batch_sizes:
    _batched(args)
    return
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
  how = (f'temperature {args.temperature:g}, top_k {args.top_k}, top_p {args.top_p:g}'
         if args.temperature else 'greedy')
  print(f'\nmodel: {results["this"][0]["params"]:,} params, vocabulary {args.vocab:,}, prompt '
        f'{args.prompt} + {args.new} new tokens, {how}')
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
