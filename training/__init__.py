"""The training application: ``train.py`` -> :func:`training.app.run`.

Modules, one job each: ``config`` (the typed schema), ``config_rules`` (the value rules), ``app`` (the program:
set-up, train or restore, outputs), ``trainer`` (the loop), ``evaluation`` (held-out metrics and renders), ``run_dir``
(the run folder's files and rules), ``scenes`` (device, seeds, scene splits), ``checkpoint`` (atomic saves, RNG state,
interrupts), ``resume`` (a checkpoint's run state), ``preflight`` (disk, memory and permission checks), ``optim``
(sparse Adam), ``losses``, ``distributed`` (torchrun), ``progress`` (the log steps' report), ``tensorboard``,
``export`` (mesh and weights files), ``viewer``/``viewer_frames``/``view`` (the live browser viewer), ``profiler``,
``metrics``, ``visualize``.
Nothing here is imported eagerly, so ``import training.config`` (what train.py needs first) stays light.
"""
