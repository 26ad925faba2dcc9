"""Entry checks on built artifacts: shared with the registry, which repeats them on the bytes it
loads, so the code lives in registry/symbols.py."""

from registry.symbols import (ElfSymbol, cubin_sm, elf_symbols, exported_functions,  # noqa: F401
                              metallib_functions, missing_entries, ptx_entries)
