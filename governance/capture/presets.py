"""Raw deflate against a preset dictionary: the compression of Steward's small stored values
(findings blobs, decision 40; a step's JSON columns, decision 60). Values of a few hundred bytes
gain little from deflate alone; a dictionary of what such values usually say (keys, entity
names, JSON paths) gives deflate something to copy from at the first byte. The dictionary is
part of each format and is never edited: a better one is a new format.

Raw deflate (no zlib header or checksum): the row's own storage is what keeps the bytes intact,
and the two bytes of header and four of checksum would be ~3 % of a 200-byte value."""

from __future__ import annotations

import zlib

_RAW = -15  # wbits for raw deflate with the largest window


def deflate(data: bytes, zdict: bytes) -> bytes:
    """`data` raw-deflated at the highest level, with `zdict` as preset dictionary."""
    packer = zlib.compressobj(9, zlib.DEFLATED, _RAW, 9, zdict=zdict)
    return packer.compress(data) + packer.flush()


def inflate(blob: bytes, zdict: bytes, what: str) -> bytes:
    """What `deflate(data, zdict)` made of `blob`, whole. A stream cut short, or bytes after
    its end, raise ValueError naming `what`; a corrupt stream raises zlib.error."""
    inflater = zlib.decompressobj(_RAW, zdict=zdict)
    data = inflater.decompress(blob) + inflater.flush()
    if not inflater.eof or inflater.unused_data:
        raise ValueError(f"truncated {what}, or bytes after its end")
    return data
