"""Llama-family decoder: config, NNX layer modules, and pure stage functions over plain params."""

from megatrain_jax.imports import import_without

# flax.nnx, before the modules below import it: without IPython, which it imports to colour its
# reprs in notebooks (megatrain_jax/imports.py).
import_without('flax.nnx', absent=('IPython',))

# pylint: disable=g-import-not-at-top,wrong-import-position
from megatrain_jax.model.config import ModelConfig
from megatrain_jax.model.decoder import (abstract_params, apply_group, apply_layer, count_params,
                                         cross_entropy, default_positions, document_positions,
                                         embed, extend, final_norm, forward, fresh_rng, head,
                                         head_loss, init_kv_cache, init_layer, init_layers,
                                         init_outer, init_outer_piece, init_params, kv_cache_slots,
                                         logits, logits_loss, loss_fn, param_keys,
                                         positions_of_batches, run_keys, token_positions)
from megatrain_jax.model.layers import RopePositions, rope_positions
from megatrain_jax.model.vocab import chunked_logits_loss, token_weights

__all__ = ['ModelConfig', 'abstract_params', 'apply_group', 'apply_layer', 'chunked_logits_loss',
           'count_params', 'cross_entropy', 'default_positions', 'document_positions', 'embed',
           'extend', 'final_norm', 'forward', 'fresh_rng', 'head', 'head_loss', 'init_kv_cache',
           'init_layer', 'init_layers', 'init_outer', 'init_outer_piece', 'init_params',
           'kv_cache_slots', 'logits', 'logits_loss', 'loss_fn', 'param_keys',
           'positions_of_batches', 'RopePositions', 'rope_positions', 'run_keys',
           'token_positions', 'token_weights']
