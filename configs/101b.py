"""~101.4B params: the Llama-3-70B layer (8192 wide, GQA 64/8, SwiGLU 28672) stacked 116 deep.

116 layers x 855.6M + 2 x 1.05B (untied embedding and head) = 101.36e9 parameters, within 0.4% of
101e9. Its FP32 training state (params, grads, Adam m and v: 16 bytes/param) is 1.62 TB.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(vocab_size=128256, d_model=8192, num_layers=116, num_heads=64,
                      num_kv_heads=8, d_ff=28672, max_seq_len=8192, rope_theta=500000.0,
                      tie_embeddings=False)
  config.train.update(seq_len=4096, batch_size=1, microbatches=16, lr=1.5e-4, warmup_steps=2000,
                      steps=50000, eval_every=1000)
  config.checkpoint.every = 100
  return config
