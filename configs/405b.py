"""~405.9B params: Llama-3.1-405B shapes (126 x 16384, GQA 128/8, SwiGLU 53248, 128256 vocab)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=128256, d_model=16384, num_layers=126, num_heads=128,
                      num_kv_heads=8, d_ff=53248, max_seq_len=131072, rope_theta=500000.0,
                      tie_embeddings=False)
  config.model.rope_scaling.update(type='llama3', factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_len=8192)
  config.train.update(seq_len=4096, batch_size=1, microbatches=16, lr=8e-5, warmup_steps=2000,
                      steps=50000, eval_every=1000)
  config.checkpoint.every = 50
  return config
