"""`python -m registry.integrations.server` (console script `mlx-aot-server`): mlx-lm 0.32.2's
OpenAI-compatible HTTP server (mlx_lm.server: /v1/chat/completions, /v1/completions, streaming,
/health) with the drop-in caches of registry/integrations/mlx_lm_cache.py.

    mlx-aot-server --model <dir> [--host 127.0.0.1] [--port 8080] [any other mlx_lm.server flag]

The flags, defaults and behaviour are mlx-lm's server's: the arguments go to mlx_lm.server.main
unchanged (`--help` lists them). Before that, a --model that names a local path is checked
(config.json, model_type, weight files) and a bad one is an error naming it; a --model that is not
a local path must look like a Hugging Face repo id (owner/name), which mlx-lm resolves.

Where mlx-lm's server gets a request's cache: it first asks its LRUPromptCache
(`fetch_nearest_cache(model_key, tokens)`) for a copy of the stored cache sharing the longest prefix
with the prompt (trimmed where needed). Only when that returns None does it make one:
`ResponseGenerator._serve_single` (requests served one at a time: --kv-bits, a request seed, images,
a draft model) calls mlx_lm.server's make_prompt_cache, `BatchGenerator.insert_segments` (batched
requests) calls mlx_lm.generate's. Every other cache the server holds is one of those, deep-copied
(fetch_nearest_cache), merged into a batch (`merge`) or extracted from one (`extract_cache`), and the
drop-in classes stay fused through all three.

The hook is therefore the prompt cache: `DropInPromptCache`, a subclass of mlx-lm's LRUPromptCache,
returns a fresh `make_prompt_cache(model)` (plus the draft model's, as _serve_single would add) where
mlx-lm's returns None for the loaded model; storing, prefix matching, trimming, eviction and byte
accounting stay mlx-lm's. It logs which layers run fused (once per model) and, per request, the
fused kernel calls so far.

What is replaced, and why: mlx-lm 0.32.2's server takes no prompt cache or cache factory from its
caller: main() builds its parser inline and calls the module-level `run(host, port, model_provider)`,
which constructs `LRUPromptCache(...)` itself. So `main()` below sets exactly one attribute,
`mlx_lm.server.run` (the global main() calls), to `run` below (mlx-lm's run with a
DropInPromptCache) for the duration of its call to `mlx_lm.server.main()`, and restores it in a
`finally`. Importing this module replaces nothing; mlx-lm's make_prompt_cache is never patched.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from http.server import ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx

from .generate import ModelLoadError, check_model_dir
from .mlx_lm import import_mlx_lm_module
from .mlx_lm_cache import fused_model, make_prompt_cache

_stock = import_mlx_lm_module("cache")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ServerStartError(RuntimeError):
    """The server cannot start: the message names the argument and why."""


class DropInPromptCache(_stock.LRUPromptCache):
    """mlx-lm's LRUPromptCache whose misses for the loaded model are fresh drop-in caches (None in
    mlx-lm, which then makes its own)."""

    def __init__(self, model_provider, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.model_provider = model_provider
        self._explained: set = set()

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        mp = self.model_provider
        if mp.model is None or model != mp.model_key:
            return cache, rest
        fm = fused_model(mp.model)
        if model not in self._explained:
            self._explained.add(model)
            logging.info("mlx-aot drop-in caches for %s:\n%s", model[0], fm.explain())
        # Per request: the fused kernel calls so far grow with every request served on drop-in caches,
        # reused ones included (the server test reads this line).
        logging.info("mlx-aot drop-in caches: %s; fused kernel calls so far: %d",
                     "new cache" if cache is None else f"reusing {len(tokens) - len(rest)} cached tokens",
                     sum(f.calls["fused"] for f in fm.fusions.values()))
        if cache is None:
            cache = make_prompt_cache(mp.model)
            if mp.draft_model is not None:
                cache += make_prompt_cache(mp.draft_model)
        return cache, rest


def run(host: str, port: int, model_provider, server_class=ThreadingHTTPServer, handler_class=None):
    """mlx_lm.server.run with a DropInPromptCache; a host/port it cannot listen on is a
    ServerStartError (after stopping the generation thread) instead of a traceback."""
    server = importlib.import_module("mlx_lm.server")
    group = mx.distributed.init()
    prompt_cache = DropInPromptCache(model_provider, model_provider.cli_args.prompt_cache_size)
    response_generator = server.ResponseGenerator(model_provider, prompt_cache)
    if group.rank() != 0:
        response_generator.join()
        return
    try:
        server._run_http_server(host, port, response_generator, server_class, handler_class or server.APIHandler)
    except OSError as e:
        response_generator.stop_and_join()
        raise ServerStartError(f"--host {host} --port {port}: cannot listen there ({e})") from None


def check_model_arg(argv: list[str]) -> None:
    """ModelLoadError for a --model that is a bad local path, or neither a path nor a repo id."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    spec = p.parse_known_args(argv)[0].model
    if spec is None:
        return                              # mlx-lm's server then loads the model each request names
    path = Path(spec)
    if path.is_dir():
        check_model_dir(path)
    elif path.exists():
        raise ModelLoadError(f"--model {spec}: not a directory")
    elif not _REPO_ID.fullmatch(spec):
        raise ModelLoadError(f"--model {spec!r}: no such directory, and not a Hugging Face repo id (owner/name)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_model_arg(argv)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = importlib.import_module("mlx_lm.server")
    saved_argv, saved_run = sys.argv, server.run
    sys.argv = ["mlx-aot-server", *argv]    # mlx-lm's main() parses sys.argv
    server.run = run                        # the one replacement: see the module docstring
    try:
        server.main()
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        server.run, sys.argv = saved_run, saved_argv
    return 0


if __name__ == "__main__":
    sys.exit(main())
