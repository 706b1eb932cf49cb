"""Data pipeline: tokenizers, the prepare step, token loading and deterministic samplers.

Typical use by the trainer:

  check_data_config(config.data)                   # during validation; writes nothing
  info, tokenizer = load_data(config.data, workdir)  # prepares (or reuses) token files
  sampler = BatchSampler(load_split(info, 'train'), seq_len=..., batch_size=...,
                         microbatches=..., seed=...)
  batch = sampler.batch(position)                  # position is saved in checkpoints

`batch` is an int32 array [microbatches, batch_size, seq_len + 1]; for a dataset with a loss mask
(instruction or chat records) it is a `Batch(tokens, loss_mask)` instead (loader.py).
"""

from megatrain_jax.data.corpus import default_corpus_text
from megatrain_jax.data.documents import (DocumentFormat, added_bos, document_format,
                                          prompt_ids)
from megatrain_jax.data.formats import read_prompts
from megatrain_jax.data.generation import sampling_defaults, stop_ids
from megatrain_jax.data.loader import (Batch, BatchSampler, MixtureSplit, batch_scalars,
                                       check_document_ends, eval_batches, load_split,
                                       open_tokens, unlearn_document_starts, unlearn_starts,
                                       verify_data)
from megatrain_jax.data.pipeline import (check_data_config, data_format,
                                         load_data, prepare_summary, prepared_digest,
                                         prepared_dirs, row_packing)
from megatrain_jax.data.prepare import DatasetInfo, prepare_dataset, read_dataset_info
from megatrain_jax.data.shards import TokenStream
from megatrain_jax.data.tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer,
                                          decode_continuation, load_tokenizer)

__all__ = [
    'Batch',
    'BatchSampler',
    'batch_scalars',
    'ByteTokenizer',
    'DatasetInfo',
    'DocumentFormat',
    'HFTokenizer',
    'Tokenizer',
    'added_bos',
    'check_data_config',
    'check_document_ends',
    'data_format',
    'decode_continuation',
    'default_corpus_text',
    'document_format',
    'eval_batches',
    'load_data',
    'load_split',
    'verify_data',
    'load_tokenizer',
    'MixtureSplit',
    'open_tokens',
    'unlearn_document_starts',
    'unlearn_starts',
    'prepare_dataset',
    'prepare_summary',
    'prepared_digest', 'prepared_dirs',
    'prompt_ids',
    'read_dataset_info',
    'read_prompts',
    'row_packing',
    'sampling_defaults',
    'stop_ids',
    'TokenStream',
]
