"""~124M params: GPT-2-small sized Llama (12 x 768, tied 50304-token embedding).

Needs a tokenizer of up to 50304 ids (`--config.data.tokenizer=/path/tokenizer.json`) for real use;
the byte tokenizer also runs (ids < 256).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=50304, d_model=768, num_layers=12, num_heads=12, num_kv_heads=12,
                      d_ff=2048, max_seq_len=2048)
  config.train.update(seq_len=1024, batch_size=8, lr=6e-4, warmup_steps=500, steps=20000,
                      eval_every=1000)
  config.checkpoint.every = 1000
  return config
