"""The default config: every field, with what it means. Size presets override only what differs.

With no `--config`, `launch.py` trains this: a ~3M-parameter Llama-style model on the embedded
default corpus (Python's own documentation text, byte-level), which runs on a laptop CPU in
minutes. Override any field from the command line: `--config.train.steps=50`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  # ---------------------------------------------------------------------------------------------
  # Model: a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3 shapes).
  # ---------------------------------------------------------------------------------------------
  config.model = model = ml_collections.ConfigDict()
  model.vocab_size = 256  # Token ids [0, vocab_size). 256 = the byte-level tokenizer.
  model.d_model = 256  # Width of the residual stream (HF hidden_size).
  model.num_layers = 4  # Decoder layers, stored stacked with a leading layer axis.
  model.num_heads = 4  # Query heads.
  model.num_kv_heads = 2  # Key/value heads (grouped-query attention); must divide num_heads.
  model.head_dim = 0  # Features per head; 0 = d_model // num_heads.
  model.d_ff = 688  # Hidden width of the SwiGLU MLP (HF intermediate_size).
  model.max_seq_len = 1024  # Longest sequence the model is meant for; train.seq_len must fit.
  model.rope_theta = 10000.0  # RoPE base period (Llama 2: 1e4, Llama 3: 5e5).
  model.rope_scaling = ml_collections.ConfigDict()
  model.rope_scaling.type = 'none'  # 'none', 'linear', 'llama3' (Llama 3.1 long context) or
  #                                   'yarn' (Qwen2.5 / Qwen3 beyond 32k: YaRN).
  model.rope_scaling.factor = 1.0  # Frequency divisor for 'linear', 'llama3' and 'yarn'.
  model.rope_scaling.low_freq_factor = 1.0  # 'llama3': wavelengths above old_len/this are scaled.
  model.rope_scaling.high_freq_factor = 4.0  # 'llama3': wavelengths below old_len/this are kept.
  model.rope_scaling.original_max_len = 8192  # 'llama3', 'yarn': the pre-extension context length.
  model.rope_scaling.beta_fast = 32.0  # 'yarn': pairs turning more than this often over the
  #                                      original length keep their frequency...
  model.rope_scaling.beta_slow = 1.0  # ...those turning less than this often are divided by
  #                                     factor; the pairs between are blended linearly.
  model.rope_scaling.attention_factor = 0.0  # 'yarn': cos and sin scale; 0 = 0.1 ln(factor) + 1.
  model.rope_scaling.truncate = True  # 'yarn': the blended band rounded out to whole pairs.
  model.qkv_bias = False  # Bias on the q/k/v projections (Qwen2).
  model.qk_norm = False  # RMSNorm of each head's q and k (scales [head_dim]) before RoPE (Qwen3).
  model.tie_embeddings = True  # LM head = embedding transposed (no separate head matrix).
  model.norm_eps = 1e-5  # RMSNorm epsilon.
  model.sliding_window = 0  # Attend only to the last N positions (Mistral); 0 = full causal.
  model.hf_architecture = ''  # The Hugging Face architecture the model was imported as
  #                              (init.from_hf sets it): --export_hf writes that one where it
  #                              computes the same function (a Mistral without a window stays
  #                              MistralForCausalLM); '' = by function: Qwen3 with qk_norm, Qwen2
  #                              with qkv_bias, Mistral with a window, else Llama.
  model.attention_chunk = 512  # Queries per attention block. Longer sequences run attention block
  #                             by block, each recomputed in the backward, so a layer holds
  #                             B·H·512·S scores instead of B·H·S·S (17 GB for 405B at 4096
  #                             tokens), and each block skips the keys causality (or
  #                             sliding_window) masks: about half the attention work. Same math;
  #                             0 = all queries at once.
  model.vocab_chunk = 0  # Vocabulary columns per block of the LM head + loss. The loss runs block
  #                         by block (online logsumexp, each block recomputed in the backward), so
  #                         it holds [tokens, chunk] float32 logits instead of [tokens, vocab_size].
  #                         Same math; 0 = auto = min(vocab_size, 8192); must be <= vocab_size.
  model.document_mask = False  # Training rows are windows of the packed token stream of
  #                               documents (records, each ending with data.eos_token). False:
  #                               attention runs across the documents of a row, positions
  #                               0..seq_len-1 (GPT-style packing). True: each token attends only
  #                               to its own document and positions restart where each begins
  #                               (as the prepare step records the records' ends, whatever ids
  #                               they hold), so a packed row computes what each document would
  #                               alone (instruction and chat data, short documents); a
  #                               document's first token is then not learned as the previous
  #                               one's target. Validation uses it, and --eval of a run trained
  #                               with it unless set. docs/data.md: Packed rows.
  model.init_std = 0.02  # Std of the normal init of every matrix (HF initializer_range).
  model.dtype = 'float32'  # Compute dtype: 'float32' or 'bfloat16'. Params are always float32.
  model.matmul_precision = 'highest'  # 'highest' = true FP32 matmuls on GPU (no TF32); 'high' or
  #                                     'default' let XLA use faster, less exact ones (TF32 there).
  model.remat = 'full'  # Per-layer rematerialisation: 'none', 'full', 'minimal' (keep matmul
  #                       outputs), 'offload' (keep them in pinned host memory).
  model.scan_layers = True  # Apply layers with lax.scan (fast compile) or an unrolled loop.
  #                            With remat 'none' the scan is unrolled (its residuals stacked
  #                            per layer cost more than they save: model/decoder.py).

  # ---------------------------------------------------------------------------------------------
  # Training.
  # ---------------------------------------------------------------------------------------------
  config.train = train = ml_collections.ConfigDict()
  train.steps = 300  # Optimizer steps in total (a resumed run continues to this count).
  train.epochs = 0.0  # > 0: passes over the training data instead: train.steps becomes
  #                      ceil(epochs * windows / (batch_size * microbatches)), counted once the data
  #                      is prepared (printed; the same on resume, where a new batch size
  #                      counts the samples left at its size). 0 = train.steps as set.
  train.microbatches = 1  # Gradient accumulation: microbatches summed into each optimizer step;
  #                         0 = auto (the planner picks enough to hide the weight streaming).
  train.batch_size = 16  # Sequences per microbatch.
  train.seq_len = 128  # Tokens per sequence (each sample holds seq_len + 1 for the shifted target).
  train.lr = 3e-3  # Peak learning rate of AdamW.
  train.warmup_steps = 50  # Linear warmup from 0 to lr, then train.lr_schedule (step s uses the
  #                          schedule at s - 1, as optax and Hugging Face count: step 1 at 0).
  train.warmup_ratio = 0.0  # > 0: the warmup is this fraction of train.steps instead, rounded up
  #                           as the Trainer does (e.g. 0.03; a run sized by train.epochs does not
  #                           know its steps in advance).
  train.lr_schedule = 'cosine'  # After the warmup: 'cosine' or 'linear' decay to lr * min_lr_ratio
  #                                at train.steps (Hugging Face Trainer's default is linear to 0:
  #                                min_lr_ratio=0), or 'constant' (lr held; min_lr_ratio unused).
  train.min_lr_ratio = 0.1  # Final learning rate as a fraction of lr.
  train.weight_decay = 0.1  # Decoupled weight decay on matrices and embeddings (not norms, biases).
  train.b1 = 0.9  # AdamW first-moment decay.
  train.b2 = 0.95  # AdamW second-moment decay.
  train.eps = 1e-8  # AdamW epsilon.
  train.grad_clip = 1.0  # Clip the global gradient norm to this value (exactly); 0 = off.
  train.log_every = 10  # Steps between metric rows (metrics.jsonl, TensorBoard, console line).
  train.eval_every = 100  # Steps between validation passes; 0 = only at the end.
  train.eval_batches = 8  # Validation batches (of batch_size sequences) per evaluation.
  train.early_stopping_patience = 0  # > 0: end the run (with a checkpoint) once eval/loss has
  #                                    not improved for this many evaluations in a row (Hugging
  #                                    Face's EarlyStoppingCallback); needs train.eval_every > 0.
  #                                    With checkpoint.keep_best the best checkpoint is kept.
  train.early_stopping_threshold = 0.0  # The least drop of eval/loss below its best that counts
  #                                       as an improvement.
  train.seed = 0  # Seeds the parameter init and the data order.
  train.progress_bar = True  # A progress bar with ETA on stderr, drawn on a terminal or in a
  #                             notebook (not into a log file or pipe: the console line has the
  #                             ETA there).

  # ---------------------------------------------------------------------------------------------
  # Data.
  # ---------------------------------------------------------------------------------------------
  config.data = data = ml_collections.ConfigDict()
  data.path = ''  # '' = embedded default corpus; else a file, a directory or a glob pattern of
  #                 .txt, .jsonl, .jsonl.zst, .jsonl.gz, .parquet (by extension; README: Train on
  #                 your own data), or a directory already prepared (holding meta.json).
  data.val_path = ''  # Validation data, like path; '' = hold out the last val_fraction of path.
  data.val_fraction = 0.05  # Share of the token stream held out for validation (when no val_path).
  data.tokenizer = 'byte'  # 'byte' (256 ids) or a path to a Hugging Face tokenizer.json (or its
  #                          directory; a tokenizer_config.json there gives EOS, BOS and the chat
  #                          template).
  data.cache_dir = ''  # Where prepared token shards go; '' = <workdir>/data.
  # Records (.jsonl*, .parquet): each is one document, stored as [BOS] text EOS.
  data.text_field = 'text'  # The record field holding a document's text.
  data.prompt_field = 'prompt'  # Records holding prompt_field and completion_field are instruction
  data.completion_field = 'completion'  # data: only the completion (and EOS) is learned (a loss
  #                                       mask is stored). Records holding `messages` are rendered
  #                                       with the tokenizer's chat template; only assistant turns
  #                                       are learned.
  data.eos_token = ''  # The token after every document; '' = eos_token of tokenizer_config.json
  #                      (the byte tokenizer: NUL, byte 0).
  data.skip_bad_records = False  # Skip (and count) malformed records instead of stopping.
  data.chat_template = ''  # A chat template file (jinja2, as transformers' chat_template.jinja)
  #                          for chat records and --sample chat instead of the tokenizer's own
  #                          (a base model's tokenizer may have none); '' = the tokenizer's
  #                          (chat_template.jinja beside tokenizer.json, else tokenizer_config.
  #                          json's). The run keeps a copy, and --export_hf writes it.
  data.text_documents = False  # Text files (.txt and others that are not records): False = one
  #                              continuous stream, as is; True = each file is one document,
  #                              [BOS] text EOS like a record (a directory of articles, books,
  #                              source files: model.document_mask then keeps them apart).
  data.pack = 'stream'  # Training and validation rows: 'stream' = windows of the token stream
  #                       (a row starts wherever the last ended, so most documents are cut in
  #                       two); 'documents' = rows of whole documents, as many as fit in stream
  #                       order, padded (padding not learned; a document longer than a row is
  #                       cut into rows): instruction and chat data keep each prompt with its
  #                       answer; 'best_fit' = the same packed best-fit decreasing (TRL's 'bfd'),
  #                       far less padding where short and long documents mix.
  data.mixture = ''  # Several sources sampled by weight, 'WEIGHT:SOURCE,WEIGHT:SOURCE' (e.g.
  #                    '0.7:web/*.jsonl.zst,0.3:code.parquet'); exclusive with path. Deterministic
  #                    and resumed exactly from checkpoints.
  data.num_workers = 0  # Tokenizing processes of the prepare step; 0 = every core.
  data.shard_tokens = 1 << 27  # The most tokens per prepared shard file (~256 MB of uint16 ids).

  # ---------------------------------------------------------------------------------------------
  # Checkpoints in <workdir>/checkpoints (megatrain_jax/checkpoint.py). A run resumes from the
  # newest intact one; any placement resumes from any other's.
  # ---------------------------------------------------------------------------------------------
  config.checkpoint = checkpoint = ml_collections.ConfigDict()
  checkpoint.every = 200  # Steps between checkpoints (one is also written at the end); 0 = end
  #                         only; -1 = never (no checkpoint of any kind, not even on SIGTERM).
  checkpoint.every_minutes = 0.0  # Also checkpoint once this many minutes have passed since the
  #                                 last checkpoint (wall clock; checked after each step); 0 = off.
  #                                 Bounds the work lost to a crash when steps are slow. SIGTERM
  #                                 and SIGINT always save the step in flight
  #                                 (docs/preemption.md: Preemptible machines and SLURM).
  checkpoint.keep = 3  # Newest checkpoints kept on disk. NVMe runs: each kept checkpoint pins one
  #                      full copy of the NVMe state on disk (hard links to the stores' files).
  checkpoint.keep_best = False  # Also keep the checkpoint of the lowest validation loss, older
  #                               than the newest `keep` or not (Hugging Face's
  #                               load_best_model_at_end): each checkpoint records its step's
  #                               eval/loss, so checkpoint.every must be a multiple of
  #                               train.eval_every. Read it with checkpoint.read=best.
  checkpoint.read = 'newest'  # The checkpoint --eval, --sample and --export_hf read (and
  #                             init.from_run of its run): 'newest', 'best' (the lowest eval/loss
  #                             recorded), or a step number ('1200').

  # ---------------------------------------------------------------------------------------------
  # Placement: where each part of the train state lives between uses. All 'device' = the resident
  # engine (everything in accelerator memory). Anything else = the streamed engine, which runs the
  # model one group of layers at a time and fetches each group's weights ahead of use.
  # ---------------------------------------------------------------------------------------------
  config.offload = offload = ml_collections.ConfigDict()
  # 'auto' (and 0 for the two counts) lets the planner (megatrain_jax/planner.py) choose: the
  # fastest placement whose memory fits the hardware profile; `--dry_run` shows its plan.
  offload.params = 'auto'  # Layer weights: 'device', 'host' (pinned host RAM), 'nvme' (disk),
  #                           'auto'.
  offload.opt_state = 'auto'  # Adam m and v of the layers: 'device', 'host', 'nvme' or 'auto'.
  offload.activations = 'auto'  # Group-boundary activations kept for backward: 'device', 'host',
  #                               'auto'.
  offload.embed_head = 'auto'  # Embedding, final norm and LM head (params + Adam state), kept
  #                              in vocabulary chunks of at most shard_mb and streamed chunk by
  #                              chunk: 'device', 'host', 'nvme' or 'auto'.
  offload.layers_per_group = 0  # K: layers per streamed group (the last may be smaller); 0 = auto.
  offload.keep_layer_inputs = 'auto'  # K > 1: 'true' keeps the K layer inputs of each group from
  #                                     the forward (K x the boundary activations; the backward
  #                                     recomputes each layer once, as with K = 1), 'false' only
  #                                     the group's input (the backward recomputes the group: a
  #                                     third forward per layer), 'auto' keeps them if they fit.
  offload.park_grads = 'auto'  # with exact clipping (train.grad_clip > 0) each group's gradient
  #                              waits for the global norm: 'weights' in the weights' tier (host
  #                              or nvme), 'device' in device memory (4 B/param of it; spares a
  #                              device update a round trip of every gradient through the host),
  #                              'auto' on the device when it fits and the update runs there.
  offload.prefetch_depth = 0  # Groups whose weights are in flight ahead of the compute; 0 = auto.
  offload.optimizer_on = 'auto'  # Where a group's AdamW update runs: 'device' (its Adam state is
  #                                fetched in and written back), 'host' (needs params and
  #                                opt_state off the device) or 'auto'.
  offload.device_memory_gb = 0.0  # Device memory the planner may fill; 0 = the hardware profile's
  #                                 (90% of it: XLA needs workspace).
  offload.host_memory_gb = 0.0  # Host RAM the planner may fill (this process's); 0 = 85% of the
  #                               profile's, split between the run's processes on one machine.
  # NVMe tier (offload.params / offload.opt_state = 'nvme'): TensorStore zarr3 arrays on disk.
  offload.dir = ''  # Directory of the NVMe stores (a local disk); '' = <workdir>/offload.
  offload.codec = 'none'  # Lossless on-disk codec: 'none', 'zstd' or 'blosc' (zstd + byte
  #                         shuffle). See BENCHMARKS.md for why 'none' is the default.
  offload.codec_level = 1  # Compression level of 'zstd' / 'blosc'.
  offload.shard_mb = 512.0  # Largest on-disk chunk (MB); a layer larger than this is split.
  offload.host_buffer_gb = 0.0  # Host RAM for the NVMe pipeline's read and write staging; 0 = auto
  #                               ((prefetch_depth + 3) groups of the disk-resident state).

  # ---------------------------------------------------------------------------------------------
  # Devices (megatrain_jax/distributed.py). One mesh axis: the batch is split across the devices
  # (data parallel) and every leaf of the train state is split across the same devices in
  # whichever tier it lives (ZeRO-3 / FSDP: each device keeps 1/N of the weights and Adam state);
  # XLA inserts the all-gathers and reduce-scatters. train.batch_size and train.microbatches
  # stay the global batch, so a run means the same on any device count.
  # ---------------------------------------------------------------------------------------------
  config.parallel = parallel = ml_collections.ConfigDict()
  parallel.devices = 0  # Devices the run uses: 0 = every visible device, else the first N of
  #                       jax.devices(). train.batch_size must be a multiple of it. On CPU,
  #                       XLA_FLAGS=--xla_force_host_platform_device_count=N (set before the
  #                       process starts) makes N devices.

  # ---------------------------------------------------------------------------------------------
  # Initial weights (megatrain_jax/hf/importer.py).
  # ---------------------------------------------------------------------------------------------
  config.init = init = ml_collections.ConfigDict()
  init.from_hf = ''  # '' = random init (model.init_std). Else a local Hugging Face checkpoint
  #                    directory (config.json + model.safetensors or a sharded index; Llama, Qwen2,
  #                    Qwen3, Mistral, Phi-3/4; F16/BF16/F32 weights, cast to float32): its shape
  #                    fields come from its config.json (a model.* shape field you set that
  #                    disagrees is an error; runtime fields such as remat, dtype, matmul_precision,
  #                    attention_chunk, vocab_chunk still apply), data.tokenizer defaults to its
  #                    tokenizer.json (copied into <workdir>/hf_tokenizer), and its weights are
  #                    read piece by piece straight into the planned tiers, Adam state zero. Read
  #                    only when the run starts: a resumed run restores its own checkpoint.
  init.from_run = ''  # Else the --workdir of another run of this package: start from the weights
  #                     of its newest checkpoint, or the one checkpoint.read names ('best', a
  #                     step), with no export to Hugging Face first, with its model
  #                     shape and tokenizer as init.from_hf takes them, Adam state zero, step 0
  #                     (continued pretraining, then fine-tuning; branching an experiment). Its
  #                     checkpoint is held while it is read, and never written.

  # ---------------------------------------------------------------------------------------------
  # Perplexity evaluation (`launch.py --eval`, megatrain_jax/evaluate.py): of the newest
  # checkpoint in --workdir, or else of init.from_hf. Results go to <workdir>/eval.json.
  # ---------------------------------------------------------------------------------------------
  config.eval = evaluation = ml_collections.ConfigDict()
  evaluation.path = ''  # What to score (required): anything data.path takes (.txt, .jsonl,
  #                       .jsonl.zst, .jsonl.gz, .parquet files, a directory, a glob), read in
  #                       order as one stream with data.tokenizer: a text file whole, records as
  #                       documents (EOS after each, data.text_field etc.); with prompt/completion
  #                       or chat records only the learned targets are scored.
  evaluation.max_len = 0  # Tokens of context per window; 0 = train.seq_len.
  evaluation.stride = 0  # A window starts every `stride` tokens; 0 = max_len (no overlap). Every
  #                        token from position 1 on is scored once, in the first window that
  #                        predicts it, with that window's context before it (so a smaller stride
  #                        gives more context, at max_len / stride times the compute).
  evaluation.batch_size = 0  # Windows per forward call; 0 = train.batch_size. Lowered (down to
  #                            one) where a call would need more than working_gb.
  evaluation.working_gb = 1.0  # The most memory one forward call may compute in: a layer's
  #                              temporaries, or the logits of one vocabulary chunk
  #                              ([windows x max_len, chunk] float32, the larger at 128k+ ids).
  #                              Past a few thousand tokens per call the matmuls run no faster.

  # ---------------------------------------------------------------------------------------------
  # Text from the model (`launch.py --sample`, megatrain_jax/sample.py): continues a prompt with
  # the newest checkpoint of --workdir, or else init.from_hf. The weights are held whole in device
  # memory (models that fit there), with a key/value cache: each new token runs the layers alone.
  # ---------------------------------------------------------------------------------------------
  config.sample = sample = ml_collections.ConfigDict()
  sample.prompt = ''  # The text to continue (required), tokenized as training tokenizes data.
  sample.chat = False  # True: the prompt is a user turn of the tokenizer's chat template, and the
  #                      model writes the assistant's reply.
  sample.system = ''  # With chat: a system turn before the user's (e.g. 'You are a pirate.').
  sample.prompts = ''  # Instead of prompt, a file of prompts continued one by one with these
  #                      settings (prompt i seeded seed + i): a text file (one per line) or
  #                      JSONL records holding data.prompt_field or chat 'messages'.
  sample.out = ''  # With prompts: the JSONL file written, a {"prompt", "completion", "tokens",
  #                  "stopped"} line per prompt.
  sample.batch_size = 8  # With prompts: how many are decoded together (each step reads the
  #                        weights once for all of them); each gets the tokens it would alone.
  sample.max_new_tokens = 200  # The most tokens to add; it stops earlier at the data's EOS (or an
  #                               eos_token_id of the tokenizer's generation_config.json).
  sample.temperature = 0.8  # Softmax temperature; 0 = greedy (always the most likely token).
  sample.top_k = 50  # Sample among the k most likely tokens; 0 = among all.
  sample.top_p = 1.0  # Then among the fewest most likely tokens holding this much probability
  #                    (nucleus sampling, e.g. 0.9); 1 = off. Greedy ignores both.
  sample.repetition_penalty = 1.0  # Divides the logits of the ids so far (1 = off; e.g. 1.05).
  # Where a generation_config.json lies beside the tokenizer (a Hugging Face model's, copied into
  # a run), the four fields above that the command line does not set follow it, as transformers'
  # generate does (no do_sample there = greedy); --sample prints what it uses.
  sample.seed = 0  # Seeds the sampling: the same seed, prompt and checkpoint give the same text.

  # ---------------------------------------------------------------------------------------------
  # Export (`launch.py --export_hf=<dir>`, megatrain_jax/export.py): the newest checkpoint of
  # --workdir as a Hugging Face checkpoint that transformers loads.
  # ---------------------------------------------------------------------------------------------
  config.export = export = ml_collections.ConfigDict()
  export.dtype = 'float32'  # Tensor dtype of the safetensors files: 'float32' or 'bfloat16'.
  export.max_shard_gb = 5.0  # Largest safetensors file (GB, 1e9 bytes); more shards + an index.

  # ---------------------------------------------------------------------------------------------
  # Runtime.
  # ---------------------------------------------------------------------------------------------
  config.runtime = runtime = ml_collections.ConfigDict()
  runtime.allocator = 'tuned'  # Host allocator (megatrain_jax/runtime.py): 'tuned' = glibc keeps
  #                               freed large buffers for reuse (one arena, no mmap'd chunks, no
  #                               automatic trimming) instead of returning them to the OS and
  #                               faulting them in again every step, while a thread hands the
  #                               heap's free pages back (malloc_trim) whenever RSS passes the
  #                               plan's predicted_host_peak_gb x 1.1 (streamed runs; resident
  #                               runs keep their heap), so RSS tracks live memory; 'system' =
  #                               glibc's defaults. Applied when the package is imported
  #                               (MEGATRAIN_JAX_ALLOCATOR=system opts out from the start) and
  #                               again with this value when training starts.
  # ---------------------------------------------------------------------------------------------
  # A jax.profiler trace of a few training steps (megatrain_jax/profiling.py): XLA ops, copies
  # between memory kinds and host threads on one timeline, into <workdir>/profile/ (TensorBoard's
  # Profile tab). docs/outputs.md: Profiling.
  # ---------------------------------------------------------------------------------------------
  config.profile = profile = ml_collections.ConfigDict()
  profile.start_step = 0  # The first step traced; 0 = off. Not 1: a process's first step compiles.
  profile.steps = 3  # Steps traced from start_step on (the trace grows by each step's ops).

  config.jax_cache_dir = '~/.cache/megatrain_jax/jax'  # Persistent XLA compile cache; '' = off.
  config.hardware = ''  # Hardware profile the planner predicts from: a preset (h100, h200, a100,
  #                       rtx4090, h100-pcie, h100-nvl, h200-nvl, gh200, cpu), a JSON file
  #                       from `launch.py --calibrate`, or '' = auto
  #                       (~/.cache/megatrain_jax/hardware.json if calibrated on this device kind,
  #                       else the preset matching the device).
  return config
