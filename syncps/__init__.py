"""syncps for training programs: what a user's own loop imports.

- :mod:`syncps.torch` (needs the ``torch`` extra: ``pip install -e '.[torch]'``): train a PyTorch
  model with a syncps PS, ``connect(model, optimizer)`` in the spirit of Horovod's
  ``DistributedOptimizer`` (docs/torch.md).
- :mod:`syncps.sampling`: which examples each worker takes at each step (numpy only).

Importing ``syncps`` itself imports neither torch nor the PS.
"""
