"""Disk I/O back ends: the contract (``base``), POSIX threads with O_DIRECT
(``posix``), kvikio/GDS (``kvikio``, probed by ``kvikio_probe``), and the
choice among them (``factory``)."""
