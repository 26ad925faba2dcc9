"""Entry checks on artifacts, without any toolchain: the ELF symbol tables of cubins and shared
libraries, the `.entry` lines of PTX, the function names of a metallib; plus the SM arch a cubin was
built for. Every `entries:` symbol of kernels.yaml must be there, or the build fails, and the
registry checks them again on the exact bytes it loads (registry/artifacts.py).

Every function takes the artifact's bytes, or a path to read them from."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Union

Source = Union[bytes, str, Path]

_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_STB_GLOBAL, _STB_WEAK = 1, 2
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_ELFOSABI_CUDA = 0x41
_SYM_SIZE = 24                     # sizeof(Elf64_Sym)


@dataclass(frozen=True)
class ElfSymbol:
    name: str
    table: str          # "symtab" | "dynsym"
    binding: int
    type: int
    defined: bool

    @property
    def exported_function(self) -> bool:
        return self.defined and self.binding in (_STB_GLOBAL, _STB_WEAK) and self.type in (_STT_FUNC, _STT_GNU_IFUNC)


def _bytes(src: Source) -> tuple[bytes, str]:
    """(data, name for messages)."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src), "the artifact"
    return Path(src).read_bytes(), str(src)


def _elf(src: Source) -> tuple[bytes, str]:
    data, path = _bytes(src)
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise ValueError(f"{path} is not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    return data, path


def elf_symbols(src: Source) -> list[ElfSymbol]:
    """Every named symbol of .symtab and .dynsym. Malformed files raise ValueError naming the file.
    The work is bounded by the file's size: tables of Elf64_Sym entries inside the file, together no
    larger than it, and names inside their string table, read once per offset and together no longer
    than the file (overlapping tables or names of a forged file would otherwise cost time and memory
    quadratic in its size)."""
    data, path = _elf(src)
    try:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        out: list[ElfSymbol] = []
        table_bytes = name_bytes = 0
        names: dict[tuple[int, int], str] = {}
        for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
            if sh_type not in (_SHT_SYMTAB, _SHT_DYNSYM) or not entsize:
                continue
            if entsize != _SYM_SIZE:
                raise ValueError(f"symbol table entries of {entsize} bytes, not {_SYM_SIZE}")
            if off + size > len(data) or link >= len(sections):
                raise ValueError("symbol table outside the file")
            str_off, str_size = sections[link][4], sections[link][5]
            if str_off + str_size > len(data):
                raise ValueError("string table outside the file")
            table_bytes += size
            if table_bytes > len(data):
                raise ValueError("symbol tables larger than the file")
            for i in range(size // entsize):
                st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", data, off + i * entsize)
                if not st_name or st_name >= str_size:
                    continue
                name = names.get((str_off, st_name))
                if name is None:
                    end = data.index(b"\0", str_off + st_name, str_off + str_size)
                    name_bytes += end - str_off - st_name
                    if name_bytes > len(data):
                        raise ValueError("symbol names longer than the file")
                    name = names[(str_off, st_name)] = data[str_off + st_name:end].decode(errors="replace")
                out.append(ElfSymbol(name,
                                     "symtab" if sh_type == _SHT_SYMTAB else "dynsym",
                                     st_info >> 4, st_info & 0xF, st_shndx != 0))
        return out
    except (struct.error, ValueError, IndexError) as e:
        raise ValueError(f"{path}: malformed ELF file ({e})") from None


def exported_functions(path: Source, table: str) -> set[str]:
    """Defined global/weak functions of one table: 'dynsym' for shared libraries (what dlsym sees),
    'symtab' for cubins (what cuModuleGetFunction sees)."""
    return {s.name for s in elf_symbols(path) if s.table == table and s.exported_function}


def cubin_sm(src: Source) -> int | None:
    """The SM number a cubin targets (90 for sm_90), from e_flags; None if not a CUDA ELF."""
    data, _ = _elf(src)
    if data[7] != _ELFOSABI_CUDA:
        return None
    flags, = struct.unpack_from("<I", data, 0x30)
    # ELF ABI version 8+ (CUDA 12.8+) moved the SM field to bits 8-15; before, bits 0-7.
    return (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF


def ptx_entries(src: Source) -> set[str]:
    # [^\S\n]: blanks of the line only (`^\s*` rescans every following blank line: quadratic time)
    return set(re.findall(r"^[^\S\n]*(?:\.visible\s+)?\.entry\s+([A-Za-z_$][\w$]*)",
                          _bytes(src)[0].decode(errors="replace"), flags=re.M))


def metallib_functions(src: Source, names: list[str]) -> set[str]:
    """Which of `names` a metallib holds. A metallib stores each function's name in a NAME tag:
    'NAME', a 16-bit length, the NUL-terminated name; matching on the non-identifier byte before
    the name and the NUL after it keeps 'f32' from matching 'rope_f32'."""
    data, path = _bytes(src)
    if data[:4] != b"MTLB":
        raise ValueError(f"{path} is not a metallib (no MTLB magic)")
    return {n for n in names if re.search(rb"(?<![A-Za-z0-9_$])" + re.escape(n.encode()) + rb"\0", data)}


def missing_entries(path: Source, kind: str, entries: list[str]) -> list[str]:
    if kind == "so":
        found = exported_functions(path, "dynsym")
    elif kind == "cubin":
        found = exported_functions(path, "symtab")
    elif kind == "ptx":
        found = ptx_entries(path)
    elif kind == "metallib":
        found = metallib_functions(path, entries)
    else:
        raise ValueError(f"unknown artifact kind {kind!r}")
    return [e for e in entries if e not in found]
