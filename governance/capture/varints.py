"""Unsigned LEB128 varints, the integers of Steward's small binary formats (placeholder deltas,
findings' spans): 1 byte below 128, 2 below 16,384."""

from __future__ import annotations


def put(n: int, out: bytearray, what: str = "blob") -> None:
    """Append `n` (>= 0) to `out`."""
    if n < 0:
        raise ValueError(f"negative integer in a {what}")
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


class Reader:
    """Reads varints and byte runs from `data`, in order; ValueError past its end, naming
    `what` it reads."""

    def __init__(self, data: bytes, what: str = "blob") -> None:
        self.data, self.pos, self.what = data, 0, what

    def varint(self) -> int:
        shift = result = 0
        while True:
            if self.pos >= len(self.data):
                raise ValueError(f"{self.what} is truncated")
            byte = self.data[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"{self.what} is truncated")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def done(self) -> None:
        """ValueError unless every byte was read."""
        if self.pos != len(self.data):
            raise ValueError(f"{self.what} has trailing bytes")
