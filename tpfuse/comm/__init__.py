"""Collectives over peer memory: ``Communicator``, its errors, and its settings (``Knobs``)."""

from tpfuse.comm.communicator import CallMismatchError, CommError, CommTimeoutError, Communicator
from tpfuse.comm.knobs import Knobs, Launch, default_knobs
from tpfuse.comm.tables import knobs_for

__all__ = ["Communicator", "CommError", "CommTimeoutError", "CallMismatchError", "Knobs", "Launch", "default_knobs",
           "knobs_for"]
