"""Byte layout of a symmetric-heap segment, shared by the collective kernels and ``smptk.comm.heap``.

Lives in the kernels layer (imports go kernels <- comm) and imports nothing, so the heap can be built
without touching Triton. Per rank, in bytes::

    [0, SIGNAL_BYTES)                       int32 [MAX_PROGRAMS, MAX_WORLD] barrier slots
    [SIGNAL_BYTES, +CONTROL_BYTES)          control words; int32 abort flag at ABORT_OFFSET
    [DATA_OFFSET, DATA_OFFSET + heap_bytes) data region (the collectives' staging buffer)
"""

MAX_PROGRAMS = 256  # max_sms may not exceed this (an H100 has 132 SMs, a B200 148)
MAX_WORLD = 64  # ranks per heap: one 8-GPU node with room for larger NVLink domains
SIGNAL_BYTES = MAX_PROGRAMS * MAX_WORLD * 4
CONTROL_BYTES = 4096
ABORT_OFFSET = SIGNAL_BYTES
DATA_OFFSET = SIGNAL_BYTES + CONTROL_BYTES
