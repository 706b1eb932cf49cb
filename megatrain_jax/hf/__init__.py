"""Hugging Face checkpoints: Llama, Qwen2, Qwen3, Mistral (and, read only, Phi-3) safetensors <->
`ModelConfig` + params.

  format.py    config.json <-> ModelConfig, the tensor name map, header checks, `load_hf` (whole,
               for tests and small models), `save_hf`
  importer.py  `init.from_hf`: the checkpoint's shape into the config, and `HfReader`, which
               serves the weights piece by piece to the engines (as a run's checkpoint does)

Export of a run's checkpoint (piece by piece, sharded) is megatrain_jax/export.py.
"""

from megatrain_jax.hf.format import (SUPPORTED_ARCHITECTURES, HfCheckpoint,
                                     hf_config_from_model_config, inspect_checkpoint, load_hf,
                                     model_config_from_hf, read_hf_config, save_hf)
from megatrain_jax.hf.importer import (MODEL_FIELDS, MODEL_TOKEN_IDS_FILE, TOKENIZER_FILES,
                                       HfReader, apply_fields, config_from_checkpoint,
                                       copy_tokenizer, model_fields, model_token_ids,
                                       tokenizer_file)

__all__ = ['MODEL_FIELDS', 'MODEL_TOKEN_IDS_FILE', 'SUPPORTED_ARCHITECTURES', 'TOKENIZER_FILES',
           'HfCheckpoint', 'HfReader', 'apply_fields', 'config_from_checkpoint', 'copy_tokenizer',
           'hf_config_from_model_config', 'inspect_checkpoint', 'load_hf', 'model_config_from_hf',
           'model_fields', 'model_token_ids', 'read_hf_config', 'save_hf', 'tokenizer_file']
