"""~6.74B params: Llama-2-7B shapes (32 x 4096, MHA, untied 32000-token vocab)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                      d_ff=11008, max_seq_len=4096, tie_embeddings=False)
  config.train.update(seq_len=4096, batch_size=1, microbatches=8, lr=3e-4, warmup_steps=1000,
                      steps=50000, eval_every=1000)
  config.checkpoint.every = 250
  return config
