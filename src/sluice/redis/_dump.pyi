from typing import Any

from numpy.typing import NDArray
from typing_extensions import Buffer

_Flat = Buffer | NDArray[Any]  # any C-contiguous buffer

def restore_commands(
    name_offsets: _Flat,
    names: _Flat,
    expiry: _Flat,
    bounds: _Flat,
    starts: _Flat,
    text_offsets: _Flat,
    texts: _Flat,
    seam: bytes,
    max_entries: int,
    max_value: int,
    resp: bool,
    /,
) -> tuple[bytes, bytes]: ...
def crc64(data: _Flat, /) -> int: ...
