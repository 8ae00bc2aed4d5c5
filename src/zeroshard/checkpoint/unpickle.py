"""Reading ``torch.save`` files (DeepSpeed's) without running any code they carry.

A ``.pt`` file is a zip archive: ``<name>/data.pkl`` (a pickle of the object graph) and one
``<name>/data/<key>`` entry of raw bytes per tensor storage. :func:`load_restricted` unpickles
``data.pkl`` with :class:`RestrictedUnpickler`, whose ``find_class`` is the only door through
which a pickle can reach code, and which hands out:

- tensor rebuilders of our own that build :class:`LazyTensor` records (storage entry, offset,
  shape, stride): bytes are read later, by element range, with positioned reads (so a rank's
  50 GB optimizer file costs nothing until a range of it is needed);
- a few inert constructors: ``collections.OrderedDict``, ``torch.Size``, torch dtypes and
  devices, ``set``/``frozenset``/``complex``/``slice``, ``_codecs.encode`` for latin-1 bytes;
- for every other class or function (DeepSpeed's loss scaler, config enums, user classes) a
  generated :class:`InertRecord` subclass that only stores what it is given;
- and for modules that can run code (``os``, ``subprocess``, ``builtins``, ``importlib``, ...)
  a :class:`~zeroshard.errors.CheckpointError` naming the file and the culprit.

No module is ever imported by the unpickler, and ``torch.load`` is not involved.
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.lazy import LazyStorage, LazyTensor, materialize
from zeroshard.errors import CheckpointError

_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "UntypedStorage": torch.uint8,
}
#: Top-level modules whose globals can run code or touch the system: a pickle naming one is refused.
DANGEROUS_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "_posixsubprocess", "sys", "builtins",
    "__builtin__", "__main__", "importlib", "imp", "runpy", "code", "codeop", "pdb", "timeit", "shutil",
    "socket", "ssl", "http", "urllib", "requests", "pickle", "_pickle", "cPickle", "dill", "marshal", "types",
    "ctypes", "cffi", "pty", "functools", "operator", "webbrowser", "multiprocessing", "concurrent", "signal",
    "io", "_io", "tempfile", "pathlib", "glob", "platform", "asyncio", "threading", "_thread", "commands",
    "popen2", "inspect", "gc", "copyreg", "copy_reg", "getattr", "eval", "exec", "site", "sysconfig",
    "zipimport", "pkgutil", "linecache", "tokenize", "ast", "compileall", "py_compile", "distutils",
    "setuptools", "pip", "shelve", "dbm", "sqlite3", "logging", "warnings", "atexit", "weakref", "abc",
    "contextlib", "traceback", "unittest", "doctest", "torch.hub", "torch.jit", "torch.ops", "torch.classes",
    "torch.serialization", "torch._C", "torch.package", "torch.utils.cpp_extension", "torch.library",
})
_SAFE_BUILTINS = {"set": set, "frozenset": frozenset, "complex": complex, "slice": slice}


class InertRecord:
    """Stand-in for a foreign class or function: construction and state only, no behaviour.

    ``foreign`` names what the pickle asked for; ``args`` holds constructor/call arguments,
    ``state`` what ``__setstate__`` received; attribute reads fall back to a dict ``state``.
    """

    foreign = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> InertRecord:
        obj = super().__new__(cls)
        obj.__dict__.update(args=args, kwargs=kwargs, state=None, items=[], mapping={})
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(args=args, kwargs=kwargs)

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state")
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) form
        if isinstance(state, dict) and name in state:
            return state[name]
        raise AttributeError(f"{self.foreign} record has no attribute {name!r}")

    def append(self, item: Any) -> None:
        """List-subclass support for APPEND."""
        self.__dict__["items"].append(item)

    def extend(self, items: Any) -> None:
        """List-subclass support for APPENDS."""
        self.__dict__["items"].extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["mapping"][key] = value

    def __repr__(self) -> str:
        return f"<inert {self.foreign} args={self.__dict__.get('args')!r} state={self.__dict__.get('state')!r}>"


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild_tensor(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> LazyTensor:
    if not isinstance(storage, tuple) or len(storage) != 2 or not isinstance(storage[0], LazyStorage):
        raise CheckpointError("malformed tensor record in pickle")
    tensor = LazyTensor(storage[0], storage[1], int(offset), tuple(int(d) for d in size), tuple(int(s) for s in stride))
    tensor.check()
    return tensor


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    return func(*args)  # func itself came through find_class: one of ours, or an inert record


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise CheckpointError("pickle used _codecs.encode for something other than latin-1 bytes")
    return text.encode("latin1")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("_codecs", "encode"): _latin1_bytes,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only tensors (lazily), plain containers and inert records."""

    def __init__(self, file: Any, source: Path, storages: dict[str, LazyStorage]) -> None:
        super().__init__(file)
        self.source = source
        self.storages = storages
        self.inert: dict[str, type[InertRecord]] = {}

    def find_class(self, module: str, name: str) -> Any:
        """Resolve a global without importing anything (see the module doc)."""
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "builtins" and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        parts = module.split(".")
        if any(".".join(parts[:i]) in DANGEROUS_MODULES for i in range(1, len(parts) + 1)) or "__" in name:
            raise CheckpointError(
                f"refusing to load {self.source}: its pickle calls {module}.{name}, which could run arbitrary "
                "code. zeroshard only builds tensors and plain data from checkpoint files; if this file is "
                "genuine, re-save it with tensors and plain containers only"
            )
        key = f"{module}.{name}"
        if key not in self.inert:
            self.inert[key] = type(name.replace(".", "_"), (InertRecord,), {"foreign": key, "__module__": __name__})
        return self.inert[key]

    def persistent_load(self, pid: Any) -> Any:
        """Storage references: ``("storage", type, key, location, numel)`` -> (lazy storage, dtype)."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"{self.source}: unsupported persistent reference in pickle")
        key = str(pid[2])
        if key not in self.storages:
            raise CheckpointError(f"{self.source}: pickle refers to storage {key!r}, which the archive lacks")
        return (self.storages[key], pid[1].dtype)


def _storages(zf: zipfile.ZipFile, path: Path, prefix: str) -> dict[str, LazyStorage]:
    out = {}
    with open(path, "rb") as f:
        for info in zf.infolist():
            if not info.filename.startswith(f"{prefix}/data/"):
                continue
            key = info.filename[len(prefix) + 6 :]
            if info.compress_type != zipfile.ZIP_STORED:
                out[key] = LazyStorage(path, 0, info.file_size, zf.read(info))
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != b"PK\x03\x04":
                raise CheckpointError(f"{path}: corrupt zip entry {info.filename}")
            n, m = struct.unpack("<HH", local[26:30])
            out[key] = LazyStorage(path, info.header_offset + 30 + n + m, info.file_size)
    return out


def load_restricted(path: str | Path) -> Any:
    """Unpickle a ``torch.save`` zip file safely; tensors come back as :class:`LazyTensor`.

    Raises:
        CheckpointError: the file is missing, not a torch zip archive, or its pickle reaches for
            code (the error names the global).
    """
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except Exception as e:  # OSError, BadZipFile, and for damaged archives UnicodeDecodeError, struct.error...
        raise CheckpointError(f"cannot read {path}: not a torch.save zip archive ({e}); legacy (pre-1.6) "
                              "torch files are not supported") from e
    try:
        with zf:
            pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkls) != 1:
                raise CheckpointError(f"{path} is not a torch.save archive (no single */data.pkl entry)")
            prefix = pkls[0][: -len("/data.pkl")]
            if f"{prefix}/byteorder" in zf.namelist() and zf.read(f"{prefix}/byteorder").strip() != b"little":
                raise CheckpointError(f"{path} was written on a big-endian machine; not supported")
            storages = _storages(zf, path, prefix)
            with zf.open(pkls[0]) as f:
                return RestrictedUnpickler(f, path, storages).load()
    except CheckpointError:
        raise
    except Exception as e:  # a damaged archive or pickle: zipfile, zlib and pickle raise many kinds
        raise CheckpointError(f"cannot unpickle {path}: {type(e).__name__}: {e}") from e


__all__ = ["DANGEROUS_MODULES", "InertRecord", "LazyStorage", "LazyTensor", "RestrictedUnpickler", "load_restricted",
           "materialize"]
