"""megatrain_jax: train language models larger than accelerator memory, in true FP32."""

__version__ = '0.1.0'
