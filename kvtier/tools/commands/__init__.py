"""The ``kvtier`` subcommands; the parser and dispatch are in ``kvtier.tools.cli``.

common   output helpers (byte sizes, progress bar, JSON)
size     ``kvtier size``: trace replay, recommendation, policy comparison
store    ``kvtier inspect`` and ``kvtier verify``
events   ``kvtier events``: KV event counts per medium
doctor   ``kvtier doctor``: host and config checks (doctor_config,
         doctor_disk, doctor_host, doctor_store: the checks by idea)
"""
