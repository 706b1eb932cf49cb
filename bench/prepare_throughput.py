"""Throughput and memory of the prepare step (`launch.py --prepare`) on a .jsonl.zst corpus.

    python bench/prepare_throughput.py [--gb 1.0] [--input FILE.jsonl.zst] [--tokenizer DIR]
                                       [--workers 1,2] [--json out.json]

Builds (unless --input is given) a .jsonl.zst of `--gb` GB of JSON lines (uncompressed), whose
records are the paragraphs of wikitext-2 (../shared/data) repeated, in a temp directory deleted
afterwards; trains (unless --tokenizer) a 8k byte-level BPE on that text (no download). Then, each
in its own subprocess (so peak RSS is the run's own):

  baseline    a plain single-process loop: zstd stream -> lines -> json.loads ->
              tokenizers.Tokenizer.encode_batch (1000 records a call), counting the ids
  prepare/N   megatrain_jax.data.prepare_dataset with num_workers=N, as `launch.py --prepare`:
              the same records -> token shards + meta.json (EOS after every document)

MB/s = 1e6 bytes of uncompressed JSONL per second. TOKENIZERS_PARALLELISM=false everywhere, so one
worker tokenizes on one thread (as the baseline does); N workers use N processes. Peak RSS: the
largest single process (getrusage RUSAGE_CHILDREN) and the largest sum over the run's process
tree (psutil, sampled every 0.1 s). The machine's other load competes for the CPUs: run it on an
otherwise idle machine for clean figures.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import zstandard

SHARED = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'wikitext-2'

_BASELINE = """
import io, json, sys, zstandard, tokenizers
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
tokens = 0
with open(sys.argv[2], 'rb') as raw:
  lines = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20)
  batch = []
  for line in lines:
    batch.append(json.loads(line)['text'])
    if len(batch) == 1000:
      tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
      batch = []
  if batch:
    tokens += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
print(json.dumps({'tokens': tokens}))
"""

_PREPARE = """
import json, sys
from megatrain_jax.data import load_tokenizer, prepare_dataset
info = prepare_dataset(sys.argv[3], load_tokenizer(sys.argv[1]), train_sources=[sys.argv[2]],
                       num_workers=int(sys.argv[4]), progress=False)
print(json.dumps({'tokens': info.train_tokens + info.val_tokens, 'shards': len(info.splits['train'])}))
"""


def _paragraphs() -> list[str]:
  text = (SHARED / 'valid.txt').read_text(encoding='utf-8') + (SHARED / 'test.txt').read_text(
      encoding='utf-8')
  return [p for p in text.split('\n \n') if p.strip()]


def build_corpus(path: Path, gb: float) -> int:
  """Writes records of repeated wikitext-2 paragraphs; returns the uncompressed JSONL bytes."""
  lines = [json.dumps({'text': p, 'meta': {'source': 'wikitext-2'}}).encode() + b'\n'
           for p in _paragraphs()]
  block = b''.join(lines)
  target, written = int(gb * 1e9), 0
  with open(path, 'wb') as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as out:
    while written < target:
      out.write(block)
      written += len(block)
  return written


def train_tokenizer(directory: Path) -> Path:
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(_paragraphs(), trainer=trainers.BpeTrainer(
      vocab_size=8192, special_tokens=['<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|endoftext|>'}))
  return directory


def _tree_rss(proc: psutil.Process) -> int:
  total = 0
  for p in [proc] + proc.children(recursive=True):
    try:
      total += p.memory_info().rss
    except psutil.Error:
      pass
  return total


def run(args: list[str]) -> dict:
  """Runs a python subprocess; returns its JSON line, wall seconds and peak RSS figures."""
  env = {**os.environ, 'TOKENIZERS_PARALLELISM': 'false'}
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  start = time.monotonic()
  proc = subprocess.Popen([sys.executable, '-c', *args], stdout=subprocess.PIPE, env=env,
                          text=True)
  peak = [0]
  watched = psutil.Process(proc.pid)

  def sample():
    while proc.poll() is None:
      try:
        peak[0] = max(peak[0], _tree_rss(watched))
      except psutil.Error:
        pass
      time.sleep(0.1)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  out, _ = proc.communicate()
  seconds = time.monotonic() - start
  thread.join()
  if proc.returncode:
    raise SystemExit(f'subprocess failed ({proc.returncode})')
  max_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
  return {**json.loads(out.strip().splitlines()[-1]), 'seconds': seconds,
          # RUSAGE_CHILDREN is the max over every child so far: None when an earlier run's was
          # larger (then peak_rss_tree_gb, sampled, is this run's figure).
          'peak_rss_process_gb': max_rss / 1e9 if max_rss > before * 1024 else None,
          'peak_rss_tree_gb': peak[0] / 1e9}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--gb', type=float, default=1.0, help='uncompressed JSONL GB to build')
  parser.add_argument('--input', default='', help='an existing .jsonl.zst (not deleted)')
  parser.add_argument('--tokenizer', default='', help='a tokenizer dir (tokenizer.json + config)')
  parser.add_argument('--workers', default='1,2')
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  tmp = Path(tempfile.mkdtemp(prefix='prepare_bench_'))
  try:
    corpus = Path(args.input) if args.input else tmp / 'corpus.jsonl.zst'
    if args.input:
      with open(corpus, 'rb') as raw:
        size = sum(len(b) for b in iter(
            lambda r=zstandard.ZstdDecompressor().stream_reader(raw): r.read(1 << 24), b''))
    else:
      size = build_corpus(corpus, args.gb)
    tok_dir = Path(args.tokenizer) if args.tokenizer else train_tokenizer(tmp / 'tok')
    tok_file = str(tok_dir / 'tokenizer.json')
    print(f'corpus {corpus}: {size / 1e9:.2f} GB JSONL, {corpus.stat().st_size / 1e6:.1f} MB on '
          f'disk; {os.cpu_count()} CPUs', flush=True)
    results = {'input_gb': size / 1e9, 'compressed_mb': corpus.stat().st_size / 1e6,
               'cpus': os.cpu_count()}
    base = results['baseline'] = run([_BASELINE, tok_file, str(corpus)])
    print(f'baseline   {size / 1e6 / base["seconds"]:7.2f} MB/s  {base}', flush=True)
    for workers in (int(w) for w in args.workers.split(',')):
      out = tmp / f'prepared-{workers}'
      got = results[f'prepare_{workers}'] = run([_PREPARE, tok_file, str(corpus), str(out),
                                                 str(workers)])
      got['vs_baseline'] = base['seconds'] / got['seconds']
      assert got['tokens'] == base['tokens'], (got['tokens'], base['tokens'])
      print(f'prepare/{workers}  {size / 1e6 / got["seconds"]:7.2f} MB/s  '
            f'({got["vs_baseline"]:.2f}x baseline)  {got}', flush=True)
      shutil.rmtree(out)
    if args.json:
      Path(args.json).write_text(json.dumps(results, indent=2))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__':
  main()
