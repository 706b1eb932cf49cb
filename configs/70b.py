"""~70.6B params: Llama-3-70B shapes (80 x 8192, GQA 64/8, untied 128256-token vocab)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=128256, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                      d_ff=28672, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False)
  config.train.update(seq_len=4096, batch_size=1, microbatches=16, lr=1.5e-4, warmup_steps=2000,
                      steps=50000, eval_every=1000)
  config.checkpoint.every = 100
  return config
