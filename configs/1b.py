"""~1.24B params: Llama-3.2-1B shapes (16 x 2048, GQA 32/8, tied 128256-token embedding)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                      d_ff=8192, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5)
  config.model.rope_scaling.update(type='llama3', factor=32.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_len=8192)
  config.train.update(seq_len=2048, batch_size=4, microbatches=4, lr=3e-4, warmup_steps=1000,
                      steps=50000, eval_every=1000)
  config.checkpoint.every = 500
  return config
