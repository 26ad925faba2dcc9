"""Entry-name checks on built artifacts: ELF symbol tables (cubin, .so), PTX `.entry` lines, and
function names inside a metallib."""

from __future__ import annotations

import re
import struct
from pathlib import Path


def elf_symbols(path: Path) -> set[str]:
    """Defined symbol names of a 64-bit little-endian ELF file (.symtab and .dynsym)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for sh_name, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type not in (2, 11) or not entsize:  # SHT_SYMTAB, SHT_DYNSYM
            continue
        str_off = sections[link][4]
        for i in range(size // entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, off + i * entsize)
            if st_name and st_shndx != 0:  # defined, named
                end = data.index(b"\0", str_off + st_name)
                names.add(data[str_off + st_name:end].decode(errors="replace"))
    return names


def ptx_entries(path: Path) -> set[str]:
    return set(re.findall(r"\.entry\s+([A-Za-z_]\w*)", path.read_text(errors="replace")))


def metallib_has(path: Path, name: str) -> bool:
    # A metallib stores each function's name as a NUL-terminated string in its function list.
    return name.encode() + b"\0" in path.read_bytes()


def missing_entries(path: Path, kind: str, entries: list[str]) -> list[str]:
    if kind in ("cubin", "so"):
        found = elf_symbols(path)
        return [e for e in entries if e not in found]
    if kind == "ptx":
        found = ptx_entries(path)
        return [e for e in entries if e not in found]
    if kind == "metallib":
        return [e for e in entries if not metallib_has(path, e)]
    raise ValueError(kind)
