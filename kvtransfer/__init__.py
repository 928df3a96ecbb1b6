"""Moving KV cache rows from a prefill node to a decode node (see `kvtransfer.interface`)."""

from kvtransfer.inproc import InprocReceiver, InprocSender
from kvtransfer.interface import DropReason, KVReceiver, KVSender, ReceiverStats, TransferEvent
from kvtransfer.wire import KVTransferError, Rendezvous, WireError, make_fingerprint
from kvtransfer.zmq_receiver import ZmqReceiver
from kvtransfer.zmq_sender import ZmqSender

__all__ = [
    "DropReason",
    "InprocReceiver",
    "InprocSender",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "ReceiverStats",
    "Rendezvous",
    "TransferEvent",
    "WireError",
    "ZmqReceiver",
    "ZmqSender",
    "make_fingerprint",
]
