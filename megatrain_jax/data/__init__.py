"""Data pipeline: tokenizers, the prepare step, token loading and deterministic samplers.

Typical use by the trainer:

  check_data_config(config.data)                   # during validation; writes nothing
  info, tokenizer = load_data(config.data, workdir)  # prepares (or reuses) token files
  sampler = BatchSampler(load_split(info, 'train'), seq_len=..., batch_size=...,
                         microbatches=..., seed=...)
  batch = sampler.batch(position)                  # position is saved in checkpoints
"""

from megatrain_jax.data.corpus import default_corpus_text
from megatrain_jax.data.loader import BatchSampler, eval_batches, load_split, open_tokens
from megatrain_jax.data.pipeline import check_data_config, load_data
from megatrain_jax.data.prepare import DatasetInfo, prepare_dataset, read_dataset_info
from megatrain_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    'BatchSampler',
    'ByteTokenizer',
    'DatasetInfo',
    'HFTokenizer',
    'Tokenizer',
    'check_data_config',
    'default_corpus_text',
    'eval_batches',
    'load_data',
    'load_split',
    'load_tokenizer',
    'open_tokens',
    'prepare_dataset',
    'read_dataset_info',
]
