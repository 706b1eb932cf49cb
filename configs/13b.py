"""~13.0B params: Llama-2-13B shapes (40 x 5120, MHA, untied 32000-token vocab)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=32000, d_model=5120, num_layers=40, num_heads=40, num_kv_heads=40,
                      d_ff=13824, max_seq_len=4096, tie_embeddings=False)
  config.train.update(seq_len=4096, batch_size=1, microbatches=8, lr=3e-4, warmup_steps=1000,
                      steps=50000, eval_every=1000)
  config.checkpoint.every = 250
  return config
