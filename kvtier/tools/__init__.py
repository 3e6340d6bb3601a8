"""The operator's tools: the ``kvtier`` command line (:mod:`~kvtier.tools.cli`
and its subcommands in :mod:`kvtier.tools.commands`), trace-driven sizing
(``sizing``, ``sizing_compare``, ``sizing_plot``, ``trace``) and the KV
events subscriber (``events_sub``). Never imported by the plugin."""
