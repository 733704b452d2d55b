"""Reading pickles from checkpoint files without running their code: allowlist unpicklers.

A pickle names the functions it calls; a plain `pickle.load` imports and calls whatever a file
names (`os.system` included). Every pickle the engine reads from a user's checkpoint goes through
one of these instead:
  - `load_dcp_metadata`: a `torch.distributed.checkpoint` `.metadata` file. Only torch's checkpoint
    metadata classes, sizes, dtypes and layouts may be built (`DCP_METADATA_GLOBALS`).
  - `load_megatron_common`: Megatron-LM's `common.pt` (`torch.save` of its args namespace, the
    iteration, ...). Plain data, `argparse.Namespace`, torch dtypes and tensors; a Megatron-core
    or numpy object (an enum such as `AttnBackend`) becomes an inert `OpaqueObject` that records
    its name and arguments: their code never runs, and the engine reads none of those values.
Anything else a file names is an `UnsafePickleError` (a ValueError: the file's fault) naming it;
a truncated or corrupt file is a ValueError as well.
"""
from __future__ import annotations

import _compat_pickle
import pickle
from pathlib import Path
from typing import Any

import torch

_PLAIN_GLOBALS = {
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "complex"), ("torch", "Size"),
    # paths: pathlib moved its classes to pathlib._local in Python 3.13
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                              "PureWindowsPath")),
}
# What a DCP .metadata may build: read off the files torch 2.x and megatron-core write.
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    # megatron-core records every rank's save plan in the metadata (`all_local_plans`)
    ("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps the text "torch.strided" to the layout object
} | _PLAIN_GLOBALS)
# What common.pt may build besides plain data: the args namespace and tensors (torch.load's own
# persistent_load supplies their storage).
COMMON_GLOBALS = frozenset({
    ("argparse", "Namespace"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch.serialization", "_get_layout"), ("torch", "device"), ("collections", "defaultdict"),
    ("datetime", "timedelta"),
    ("_codecs", "encode"),  # how protocol 2 writes bytes (torch's weights_only loader admits it as well)
    # plain types a defaultdict names as its factory
    *(("builtins", t) for t in ("list", "dict", "tuple", "int", "float", "str", "bool")),
} | _PLAIN_GLOBALS)
_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))
# Modules whose objects common.pt may hold as inert records (Megatron's enums and dataclasses, numpy
# scalars and arrays): the module is never imported, the object is its name and arguments.
_OPAQUE_PREFIXES = ("megatron.", "numpy.")
_CORRUPT = (pickle.UnpicklingError, EOFError, AttributeError, TypeError, IndexError, KeyError, ValueError,
            RuntimeError)


class UnsafePickleError(ValueError):
    """A pickle names a function or class outside the allowlist."""


class OpaqueObject:
    """What a Megatron-core object in common.pt is read as: its name, arguments and state, inert."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "OpaqueObject":  # pickle's NEWOBJ calls cls.__new__(cls, *args)
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


class _Allowlist(pickle.Unpickler):
    allowed: frozenset = frozenset()
    opaque = False
    what = "pickle"

    def find_class(self, module: str, name: str) -> Any:
        # protocol 0-2 pickles (torch.save writes 2) may use Python 2 names (`__builtin__.list`); map them
        # as pickle's own find_class does, before the allowlist sees them
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in self.allowed:
            return super().find_class(module, name)  # imports only torch's and the standard library's modules
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        if self.opaque and f"{module}.".startswith(_OPAQUE_PREFIXES):
            return type(name, (OpaqueObject,), {"qualname": f"{module}.{name}"})
        raise UnsafePickleError(f"{self.what} names {module}.{name}, which is not on the allowlist of what "
                                "it may hold; refusing to unpickle it")


class _MetadataUnpickler(_Allowlist):
    allowed = DCP_METADATA_GLOBALS
    what = "checkpoint metadata (.metadata)"

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.what} refers to external storage {pid!r}, which it may not hold")


def load_dcp_metadata(file: str | Path) -> Any:
    """The `Metadata` of a DCP checkpoint's `.metadata` file, through the allowlist."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        with path.open("rb") as f:
            meta = _MetadataUnpickler(f).load()
    except UnsafePickleError as err:
        raise UnsafePickleError(f"{path}: {err}") from None
    except _CORRUPT as err:
        raise ValueError(f"{path} is truncated or corrupt ({type(err).__name__}: {err})") from None
    if not isinstance(meta, Metadata):
        raise ValueError(f"{path} holds a {type(meta).__name__}, not checkpoint metadata")
    return meta


class _CommonUnpickler(_Allowlist):
    """No persistent_load of its own: torch.load sets the one that reads tensor storage."""

    allowed = COMMON_GLOBALS
    opaque = True
    what = "common.pt"


class _CommonPickleModule:
    """What torch.load needs of a pickle module (`Unpickler`, `load`), with the allowlist.

    torch.load subclasses `Unpickler` (its find_class maps storage type names to its own inert
    `StorageType`, then defers to ours) and sets the persistent_load that reads tensor storage.
    """

    Unpickler = _CommonUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(f: Any, **kw: Any) -> Any:
        return _CommonUnpickler(f, **kw).load()


def load_megatron_common(file: str | Path) -> Any:
    """The object `torch.save`d in a Megatron `common.pt`, through the allowlist (never plain pickle)."""
    path = Path(file)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_CommonPickleModule)
    except UnsafePickleError as err:
        raise UnsafePickleError(f"{path}: {err}") from None
    except _CORRUPT as err:
        raise ValueError(f"{path} is truncated or corrupt ({type(err).__name__}: {err})") from None
