"""Why torch.load refused a file, in one line: not a checkpoint at all, a pickle refused as
unsafe, or a checkpoint damaged on its way (cut short, corrupted), which says what was expected
and how much was found."""

from __future__ import annotations

import io
import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path

ZIP_ENTRY = b"PK\x03\x04"  # what a torch.save zip archive begins with
PICKLE = b"\x80"  # what a legacy (pre-1.6) torch.save pickle begins with
HEAD_BYTES = 64 << 20  # read this much at most to find out how large a cut file should be


def is_torch_file(path: Path) -> bool:
    """Whether ``path`` is what torch.save writes: a zip archive, or a legacy pickle."""
    with open(path, "rb") as f:
        return zipfile.is_zipfile(f) or (f.seek(0) == 0 and f.read(1) == PICKLE)


def load_error(src: Path, e: Exception, trust: bool) -> str:
    """Why torch.load refused ``src``, in one line."""
    damage = damaged(src, e)
    if damage is not None:
        return damage
    if src.is_file() and src.stat().st_size and not is_torch_file(src):
        # A text file, say: torch says UnpicklingError (--trust would not help) or KeyError: 101
        return f"{src} is not a torch checkpoint (neither a torch.save zip nor a pickle)"
    if isinstance(e, pickle.UnpicklingError):  # weights_only refuses arbitrary pickled objects
        hint = "" if trust else "; pass --trust if you trust the file"
        return f"cannot load {src} safely ({unpickler_reason(e)}){hint}"
    reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return f"{src} is not a readable checkpoint ({reason})"


def unpickler_reason(e: Exception) -> str:
    """What torch's weights_only refusal names (its message is paragraphs, with ANSI codes)."""
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. Please|\n|$)", str(e))
    text = found.group(1) if found else str(e).split("\n", 1)[0]
    return re.sub(r"\x1b\[[0-9;]*m", "", text).strip() or type(e).__name__


def damaged(src: Path, e: Exception) -> str | None:
    """A one-line report when ``src`` begins as a torch.save file but torch could not read it
    to the end (None when it does not look damaged): torch's own words are a miniz "failed
    finding central directory", an EINVAL OSError or an EOFError, which send users looking
    for the wrong problem."""
    if not src.is_file():
        return None
    size = src.stat().st_size
    if size == 0:
        return f"{src} is empty (0 bytes), not a checkpoint"
    with open(src, "rb") as f:
        head = f.read(HEAD_BYTES)
    if head.startswith(ZIP_ENTRY) and not zipfile.is_zipfile(src):
        needed = _tensor_bytes(head)
        tensors = f"; its tensors alone take {needed:,} bytes" if needed and needed > size else ""
        return (
            f"{src} is a damaged checkpoint, cut short: a torch.save zip archive ends with its "
            f"zip directory, and this file stops after {size:,} bytes without one{tensors}"
        )
    if head.startswith(ZIP_ENTRY) and _torch_archive(src):
        bad = _failed_crc(src)
        if bad is not None:
            return f"{src} is a damaged checkpoint: its member {bad} fails the zip's CRC check"
        if isinstance(e, RuntimeError):  # torch's reader could not take a member
            return f"{src} is a damaged checkpoint ({size:,} bytes): {str(e).split('. ', 1)[0]}"
    truncated = isinstance(e, EOFError) or "truncated" in str(e) or "unexpected EOF" in str(e)
    if head.startswith(PICKLE) and truncated:
        more = re.search(r"expected (\d+) more bytes", str(e))
        expected = f" of at least {size + int(more.group(1)):,}" if more else ""
        return (
            f"{src} is a damaged checkpoint, cut short: a legacy torch.save pickle that ends "
            f"after {size:,} bytes{expected}"
        )
    return None


def _torch_archive(src: Path) -> bool:
    """Whether a whole zip archive is one torch.save wrote (it holds a data.pkl), so that a
    member torch cannot read is damage, not a foreign zip."""
    with zipfile.ZipFile(src) as archive:
        return any(name.endswith("/data.pkl") for name in archive.namelist())


def _failed_crc(src: Path) -> str | None:
    """The first member of a zip archive whose bytes do not match their CRC (torch.save
    records one for each), read on this error path only."""
    with zipfile.ZipFile(src) as archive:
        try:
            return archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:  # a member cut or unreadable
            return f"({e})"


def _tensor_bytes(head: bytes) -> int | None:
    """The bytes of tensor data the archive's first entry (``data.pkl``, written first) refers
    to, read without building any object; None where that entry cannot be read."""
    try:
        name_length, extra_length = struct.unpack("<HH", head[26:30])
        if not head[30 : 30 + name_length].endswith(b"data.pkl"):
            return None
        unpickler = _StorageSizes(io.BytesIO(head[30 + name_length + extra_length :]))
        unpickler.load()
    except Exception:  # a cut or unexpected data.pkl: say only what is certain
        return None
    return sum(unpickler.sizes.values())


class _Anything:
    """Stands for every object a data.pkl builds: nothing of the file is executed."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass

    def __setitem__(self, key, value) -> None:
        pass

    def append(self, value) -> None:
        pass

    def extend(self, values) -> None:
        pass


class _StorageSizes(pickle.Unpickler):
    """Reads a torch.save data.pkl for the size of each storage it refers to (torch's
    persistent ids: ("storage", storage type, key, location, element count))."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.sizes: dict[str, int] = {}

    def find_class(self, module: str, name: str):
        if module == "torch" and name.endswith("Storage"):
            return _item_size(name)
        return _Anything

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            self.sizes[str(pid[2])] = int(pid[4]) * int(pid[1])
        return _Anything()


def _item_size(storage_type: str) -> int:
    """Bytes per element of a torch storage type named in a pickle ("BFloat16Storage": 2)."""
    import torch

    if storage_type == "UntypedStorage":
        return 1
    with warnings.catch_warnings():  # TypedStorage is deprecated, and says so
        warnings.simplefilter("ignore")
        return getattr(torch, storage_type).dtype.itemsize
