"""Collectives over peer memory: ``Communicator`` and its errors."""

from tpfuse.comm.communicator import CommTimeoutError, Communicator

__all__ = ["Communicator", "CommTimeoutError"]
