"""Byte layout of a symmetric-heap segment and the codes of a call, shared by the collective kernels and
``smptk.comm``.

Lives in the kernels layer (imports go kernels <- comm) and imports nothing, so the heap can be built, and a
call checked or sent to torch.distributed's fallback, without importing Triton. Per rank, in bytes::

    [0, SIGNAL_BYTES)                       int32 [MAX_PROGRAMS, MAX_WORLD] barrier slots
    [SIGNAL_BYTES, +CONTROL_BYTES)          control words:
        ABORT_OFFSET                        int32 abort flag (set by the host watchdog)
        CALL_OFFSET                         int64 [3] this rank's current call (tag, numel, chunk)
        SEEN_OFFSET                         int64 [MAX_WORLD, 3] peers' calls that differed from ours
        BLOCKS_OFFSET                       int64 [MAX_WORLD] the GEMM + reduce-scatter's arrivals: word q
                                            holds the call tag once rank q's partial of this rank's block
                                            is in this rank's data region (smptk.kernels._gemm_comm)
    [DATA_OFFSET, DATA_OFFSET + heap_bytes) data region (the collectives' staging buffer)
"""

MAX_PROGRAMS = 256  # max_sms may not exceed this (an H100 has 132 SMs, a B200 148)
MAX_WORLD = 64  # ranks per heap: one 8-GPU node with room for larger NVLink domains
SIGNAL_BYTES = MAX_PROGRAMS * MAX_WORLD * 4
CONTROL_BYTES = 4096
ABORT_OFFSET = SIGNAL_BYTES
CALL_OFFSET = SIGNAL_BYTES + 64  # 8-byte aligned; three int64 words
SEEN_OFFSET = SIGNAL_BYTES + 128  # MAX_WORLD x 3 int64 words = 1536 bytes, ends well inside CONTROL_BYTES
BLOCKS_OFFSET = SIGNAL_BYTES + 2048  # MAX_WORLD int64 words = 512 bytes, after SEEN's 1536
DATA_OFFSET = SIGNAL_BYTES + CONTROL_BYTES

# Reduction op codes, the kernels' OP constexpr (smptk.kernels.collectives._combine).
OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3}
# Call tag = sequence number << SEQ_SHIFT | what the call is (packed by smptk.comm.collectives._Call; the
# kernels compare the sequence numbers of their own and a peer's announced call).
SEQ_SHIFT = 24
