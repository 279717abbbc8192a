"""acache-jax: affix-cache inference for diffusion LLMs (LLaDA, Dream) in JAX.

The public API: `load` a model, `build_affix_cache` once per shared affix, `acache_jax.decoding.decode.generate`
(the static, jitted path; `acache_jax.generate` is the command line) or `Engine` (continuous
batching) with a `DecodeConfig` (`model.decode_config(...)` starts from the model's generation
defaults), requests as `Request`s. `make_mesh` + `load(..., mesh=)` split a model over devices.

The folders: `network/` (the model and its files), `decoding/` (the static path and the affix
cache), `engine/`, `serve/`, `lm_eval/`; docs/ARCHITECTURE.md walks through them. The modules'
paths from before the folders (`acache_jax.model`, `acache_jax.decode`, ...) still import, with a
DeprecationWarning.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

from acache_jax.decoding.acache import build_affix_cache
from acache_jax.decoding.decode import GenerateResult
from acache_jax.decoding.layout import Request, RequestError
from acache_jax.engine import Engine, EngineResult
from acache_jax.network.checkpoint import load
from acache_jax.network.config import ConfigError, DecodeConfig, DecodeError, InputError, ModelConfig
from acache_jax.network.kv import AffixCache, KVPool
from acache_jax.network.model import ForwardOutput, Model, Transformer
from acache_jax.network.sharding import MeshError, make_mesh

__all__ = ["AffixCache", "ConfigError", "DecodeConfig", "DecodeError", "Engine", "EngineResult", "ForwardOutput",
           "GenerateResult", "InputError", "KVPool", "MeshError", "Model", "ModelConfig", "Request", "RequestError",
           "Transformer", "build_affix_cache", "load", "make_mesh"]

# Module -> the folder it moved into. Its old path imports the module itself (one object, so
# patching through either path patches both), and warns.
_MOVED = {**dict.fromkeys(("attention", "checkpoint", "config", "files", "hf_checkpoint", "kv", "model", "sharding",
                           "tokenizer"), "network"),
          **dict.fromkeys(("acache", "decode", "layout", "sampling"), "decoding"),
          **dict.fromkeys(("chat_layout", "likelihood"), "lm_eval")}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        package, _, module = name.rpartition(".")
        return importlib.util.spec_from_loader(name, self) if package == __name__ and module in _MOVED else None

    def create_module(self, spec):
        module = spec.name.rpartition(".")[2]
        new = f"{__name__}.{_MOVED[module]}.{module}"
        # attributed to the line that imported the old path, past the import machinery's frames and
        # this package's (whose own modules import the new paths only)
        warnings.warn(f"{spec.name} is now {new}", DeprecationWarning,
                      skip_file_prefixes=(os.path.dirname(importlib.__file__), os.path.dirname(__file__)))
        moved = importlib.import_module(new)
        spec.loader_state = moved.__spec__  # the import system sets __spec__ to this alias's spec
        return moved

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


sys.meta_path.append(_OldPaths())


def __getattr__(name: str):
    """`acache_jax.model` and the other old paths as attributes, as before the folders."""
    if name in _MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
