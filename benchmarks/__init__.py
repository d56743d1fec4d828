"""k3lab benchmarks. Each is a module run from the repo root as ``python -m benchmarks.<name> ...``
(``--help`` lists its options); each prints its table to the terminal. ``conv_bench``, ``kda_bench``,
``kda_train_check``, ``kernel_resources``, ``ladder_speed``, ``muon_bench``, ``qb_lag`` and ``step`` also write
it to ``--out PATH``; the two that train (``kda_train_check``, ``qb_lag``) leave run directories. Measured tables,
with command, commit, date and machine: ``benchmarks/RESULTS.md``. Every benchmark times a callable through
``benchmarks.timing`` (the median call and its interquartile range; ``triton.testing.do_bench`` on CUDA) and
prints its Markdown tables through pandas (``benchmarks.table``).

- ``kda_bench``: KDA kernels, forward and forward+backward time of ours vs fla's ``chunk_kda``, the
  plain PyTorch path and causal SDPA; ``--check`` bf16 accuracy, ``--profile`` per-kernel GPU time.
- ``kda_tune``: searches the KDA kernels' launch table (``kernels.kda.triton_fwd.LAUNCH``), or times
  one given table against fla.
- ``kda_ncu``: one forward+backward of the KDA kernels for Nsight Compute
  (``ncu ... python -m benchmarks.kda_ncu``).
- ``kda_decay``: how far the KDA decay falls inside the kernels' 16-token sub-blocks while a model trains.
- ``conv_bench``: the KDA short conv (+ SiLU), torch path, fused Triton op and fla's ``causal_conv1d``.
- ``kda_train_check``: the fused kernels inside training, the loss curve and step time of each variant (backend, compile).
- ``attnres_bench``: residual options (standard, block and full AttnRes), step time and activation
  memory; ``--profile`` and ``--tune`` for the fused mix kernels.
- ``moe_bench``: MoE layer forward+backward, grouped-matmul dispatch vs a per-expert loop; ``--experts`` the
  routed experts alone, compiled grouped matmuls (checkpointed or not) against the fused kernels.
- ``kernel_resources``: the fused experts' kernels compiled for sm_90 without a GPU, per launch configuration:
  shared memory, programs per SM, pipelined loads, wgmma.
- ``muon_bench``: the optimizer step of a config's model on random gradients, whole and by part, against
  its roofline.
- ``qb_lag``: trains with a probe that splits Quantile Balancing's MaxVio into its causes.
- ``step``: the training step of any config, in a bare loop and through run.py's trainer, tokens/s, ms/step,
  MFU and peak memory, one row per ``--variants`` override set; ``--fla`` adds fla's ``KDAForCausalLM``.
- ``ladder_speed``: the ladder's small models through the trainer, each alone and several packed on one
  device, eager, compiled and with CUDA graphs: tokens/s, MFU, the GPU-minutes of a study slice, and the
  setting a measured rule chooses per depth.
"""
