"""Peak RSS and time of `launch.py --eval` at a real vocabulary, against the printed prediction.

  PYTHONPATH=. python bench/eval_memory.py [--batch_sizes 8 32] [--max_len 2048]
      [--working_gb 1.0] [--repo /path/to/another/tree]

Builds (once, in --dir) a random Qwen2-shaped Hugging Face model with Qwen2's 151,936 ids
(d_model 512, 4 layers, untied head: 167M params, 0.67 GB), and a byte-level BPE tokenizer
trained on WikiText-2 validation text, then evaluates the first --chars characters of WikiText-2
test with each batch size, each in a fresh `launch.py --eval` process under a wrapper whose
RUSAGE_CHILDREN peak is that process's (whole-process peak RSS). `--repo` runs another tree's
launch.py on the same model and text (a tree before eval.working_gb ignores that flag's absence:
it is passed only where this tree's config has it).
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / 'shared' / 'data' / 'wikitext-2'
WRAPPER = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); '
           'print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); '
           'sys.exit(r.returncode)')


def make_model(directory: pathlib.Path) -> None:
  import tokenizers  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  if (directory / 'tokenizer.json').is_file():
    return
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=151_936, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
      tie_word_embeddings=False)).save_pretrained(directory)
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator([(WIKITEXT / 'valid.txt').read_text()], tokenizers.trainers.BpeTrainer(
      vocab_size=4000, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.save(str(directory / 'tokenizer.json'))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dir', default='/tmp/megatrain_eval_memory')
  parser.add_argument('--batch_sizes', type=int, nargs='+', default=[8, 32])
  parser.add_argument('--max_len', type=int, default=2048)
  parser.add_argument('--chars', type=int, default=60_000)
  parser.add_argument('--working_gb', type=float, default=None)
  parser.add_argument('--repo', default=str(ROOT), help='the tree whose launch.py runs')
  args = parser.parse_args()
  directory = pathlib.Path(args.dir)
  make_model(directory / 'model')
  text = directory / 'eval.txt'
  text.write_text((WIKITEXT / 'test.txt').read_text()[:args.chars])
  for batch in args.batch_sizes:
    flags = [f'--config.init.from_hf={directory / "model"}', f'--config.eval.path={text}',
             f'--config.eval.max_len={args.max_len}', f'--config.eval.batch_size={batch}',
             '--config.train.progress_bar=False', f'--workdir={directory / "run"}']
    if args.working_gb is not None:
      flags.append(f'--config.eval.working_gb={args.working_gb}')
    run = subprocess.run([sys.executable, '-c', WRAPPER, sys.executable, 'launch.py', '--eval',
                          *flags], cwd=args.repo, capture_output=True, text=True)
    if run.returncode:
      raise SystemExit(run.stderr[-3000:])
    peak = int(re.search(r'PEAK (\d+)', run.stdout).group(1)) / 1e9
    predicted = re.search(r'predicted_host_peak_gb: ([0-9.]+)', run.stdout)
    plan = re.search(r'^eval: .*$', run.stdout, re.M)
    result = json.loads((directory / 'run' / 'eval.json').read_text())
    print(json.dumps({
        'batch_size': batch, 'max_len': args.max_len, 'peak_rss_gb': round(peak, 3),
        'predicted_host_peak_gb': float(predicted.group(1)) if predicted else None,
        'eval_seconds': round(result['eval/seconds'], 2), 'eval_loss': result['eval/loss'],
        'plan': plan.group(0) if plan else None, 'repo': args.repo}), flush=True)


if __name__ == '__main__':
  main()
