"""Collectives over peer memory: ``Communicator`` and its errors."""

from tpfuse.comm import tables
from tpfuse.comm.communicator import CommError, CommTimeoutError, Communicator

# Measured tables (tables/w{W}.json) replace the plans' defaults for their world size. Here,
# so that the plan modules are complete first and every import path sees the tables applied.
tables.apply_tables()

__all__ = ["Communicator", "CommError", "CommTimeoutError"]
