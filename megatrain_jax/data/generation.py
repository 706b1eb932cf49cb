"""What a generation_config.json beside the tokenizer says about generating text (`--sample`).

Hugging Face checkpoints ship one next to tokenizer.json, and it travels with the tokenizer into
a run (<workdir>/hf_tokenizer) and out of it (`--export_hf`). transformers' `generate` reads two
things from it that `--sample` follows too:

  stop ids   `eos_token_id`, an id or a list: Llama 3 Instruct ends a turn with <|eot_id|> and a
             text with <|end_of_text|> and names both (and <|eom_id|>); the data's EOS is one.
  sampling   `do_sample`, `temperature`, `top_k`, `top_p`, `repetition_penalty`: the settings
             the model's authors recommend (Qwen2.5 Instruct: 0.7, 20, 0.8, 1.05). Absent
             `do_sample` means greedy, as transformers' GenerationConfig has it.
"""

import math
from pathlib import Path
from typing import Any

from megatrain_jax import fs
from megatrain_jax.data.documents import DocumentFormat, document_format
from megatrain_jax.data.tokenizer import Tokenizer
from megatrain_jax.errors import ConfigError

GENERATION_CONFIG = 'generation_config.json'
# transformers' GenerationConfig defaults for the sampling fields a file leaves out.
_HF_SAMPLING_DEFAULTS = {'temperature': 1.0, 'top_k': 50, 'top_p': 1.0, 'repetition_penalty': 1.0}


def read_generation_config(tokenizer: Tokenizer) -> tuple[dict[str, Any], Path | None]:
  """(the generation_config.json beside the tokenizer's tokenizer.json, its path): ({}, None)
  where there is none (the byte tokenizer, or a tokenizer without one).

  Raises:
    ConfigError: (naming the file) it is not a JSON object.
  """
  path = getattr(tokenizer, 'path', None)
  config_path = None if path is None else Path(path).parent / GENERATION_CONFIG
  if config_path is None or not config_path.is_file():
    return {}, None
  try:
    config = fs.read_json_at_most(config_path, '--sample', f'a {GENERATION_CONFIG} is a few '
                                  'hundred bytes: fix or remove it')
  except ConfigError:
    raise
  except (OSError, ValueError) as e:
    raise ConfigError(f'--sample: {config_path} is not JSON ({e}); fix or remove it.') from e
  if not isinstance(config, dict):
    raise ConfigError(f'--sample: {config_path} is not a JSON object; fix or remove it.')
  return config, config_path


def stop_ids(tokenizer: Tokenizer, fmt: DocumentFormat) -> tuple[int, ...]:
  """The ids that end a generated text: the data's EOS, the tokenizer's own (an instruct
  tokenizer's turn end, where the run's data.eos_token ends its documents instead) and
  generation_config.json's `eos_token_id` (an id or a
  list), as transformers' `generate` stops.

  Raises:
    ConfigError: (naming the file) it is not a JSON object, or its eos_token_id holds something
      other than token ids of this tokenizer.
  """
  config, path = read_generation_config(tokenizer)
  eos = config.get('eos_token_id')
  listed = [] if eos is None else eos if isinstance(eos, list) else [eos]
  if not all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in listed):
    raise ConfigError(f'--sample: {path} has eos_token_id={eos!r}: not ids of the '
                      f'tokenizer (0..{tokenizer.vocab_size - 1}); fix or remove it.')
  return tuple(sorted({fmt.eos, *_own_eos(tokenizer), *listed}))


def _own_eos(tokenizer: Tokenizer) -> tuple[int, ...]:
  """The tokenizer's own EOS id (its tokenizer_config.json's), or () where it names none."""
  try:
    return (document_format(tokenizer).eos,)
  except ConfigError:
    return ()


def sampling_defaults(tokenizer: Tokenizer, chosen=()) -> tuple[dict[str, float], Path | None]:
  """({sample.* field: value}, the file): what generation_config.json asks of the fields
  `temperature` (0 = greedy, where `do_sample` is false or absent), `top_k`, `top_p` and
  `repetition_penalty`, with transformers' defaults for those it leaves out, except the
  `chosen` ones (set on the command line; not read); ({}, None) without a file.

  Raises:
    ConfigError: (naming the file and field) a value of the wrong type or out of range.
  """
  config, path = read_generation_config(tokenizer)
  if path is None:
    return {}, None
  values = {**_HF_SAMPLING_DEFAULTS,
            **{k: config[k] for k in _HF_SAMPLING_DEFAULTS if config.get(k) is not None}}
  if not config.get('do_sample'):
    values['temperature'] = 0.0
  values = {k: v for k, v in values.items() if k not in chosen}
  for field, value in values.items():
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value) or value < 0 or (
        field in ('top_p', 'repetition_penalty') and value == 0) or (
            field == 'top_p' and value > 1):
      raise ConfigError(f'--sample: {path} has {field}={value!r}, which transformers would not '
                        f'take; fix it, or set sample.{field} on the command line.')
  if 'top_k' in values:
    values['top_k'] = int(values['top_k'])
  return values, path
